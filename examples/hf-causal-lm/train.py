"""A Hugging Face transformers causal LM (Llama architecture, ~3.3M parameters, built from a config:
no weights downloaded) trained with DiLoCo on local text: the Python standard library's source,
byte-level, so no tokenizer download either.

The training loop is the one you already have for a transformers model (model(input_ids,
labels=...).loss, AdamW, a warmup + cosine schedule from transformers); adopting DiLoCo is the
lines marked `# DiLoCo`:

    diloco = DiLoCo(model, optimizer, ctx)                 # wraps the model you built
    for step in diloco.steps(total_steps):                  # resumes at the global step after a restart
        ...the usual forward / backward / optimizer.step()...
        diloco.step(loss=loss.item(), tokens=...)           # every H steps: the outer sync through the store
    diloco.close()

`ctx` is the `ReplicaContext` diloco passes the entrypoint (rank, run id, rendezvous); the spec
next to this file runs it: `diloco run examples/hf-causal-lm/diloco.toml`.
"""

from __future__ import annotations

import json
import math
import os
import sysconfig
import time
import zlib
from pathlib import Path

import torch

from diloco.bootstrap.context import ReplicaContext


def stdlib_sources(root: Path) -> list[Path]:
    """The stdlib's .py files, sorted, without site-packages/ and the test suites, pruned from the
    walk rather than filtered after it (site-packages alone is many times the stdlib)."""
    found = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in ("site-packages", "test", "tests")]
        found += [Path(folder, name) for name in names if name.endswith(".py")]
    return sorted(found)


def byte_corpus(max_bytes: int, eval_fraction: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and eval token tensors (bytes 0-255) from the stdlib's .py files, split by file."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, held_out, total = [], [], 0
    for path in stdlib_sources(root):
        data = path.read_bytes()
        split = held_out if zlib.crc32(str(path.relative_to(root)).encode()) % 100 < eval_fraction * 100 else train
        split.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    as_tokens = lambda parts: torch.frombuffer(bytearray(b"\n".join(parts)), dtype=torch.uint8).long()  # noqa: E731
    return as_tokens(train), as_tokens(held_out)


def sample(data: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, data.numel() - seq_len, (batch_size,), generator=gen)
    return data[starts[:, None] + torch.arange(seq_len)]


def build_model(seed: int, hidden: int, layers: int, heads: int, seq_len: int):
    """A small Llama from a config; the same seed gives every replica the same θ₀."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=int(hidden * 8 / 3 + 63) // 64 * 64,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=seq_len, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


@torch.no_grad()
def evaluate(model, data: torch.Tensor, batch_size: int, seq_len: int, batches: int = 8) -> float:
    gen = torch.Generator().manual_seed(1234)
    model.eval()
    losses = [model(input_ids=(x := sample(data, batch_size, seq_len, gen)), labels=x).loss.item()
              for _ in range(batches)]
    model.train()
    return sum(losses) / len(losses)


def train(ctx: ReplicaContext, steps: int | None = None, batch_size: int = 8, seq_len: int = 128, hidden: int = 256,
          layers: int = 4, heads: int = 4, lr: float = 1e-3, warmup: int = 30, seed: int = 0, threads: int = 1,
          max_bytes: int = 3_000_000, eval_every: int = 0) -> dict:
    from transformers import get_cosine_schedule_with_warmup

    from diloco_replica import DiLoCo  # DiLoCo

    torch.set_num_threads(threads)
    train_data, eval_data = byte_corpus(max_bytes)
    model = build_model(seed, hidden, layers, heads, seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    diloco = DiLoCo(model, optimizer, ctx)  # DiLoCo
    steps = steps or diloco.total_steps or 300
    schedule = get_cosine_schedule_with_warmup(optimizer, warmup, steps)
    for _ in range(diloco.global_step):  # a relaunched replica continues the schedule where the run is
        schedule.step()
    n_params = sum(p.numel() for p in model.parameters())
    ctx.log.info("Llama %.2fM parameters; starting at step %d", n_params / 1e6, diloco.global_step)
    started = time.monotonic()
    for step in diloco.steps(steps):  # DiLoCo: instead of range(steps)
        gen = torch.Generator().manual_seed(hash((seed, ctx.rank, step)) & 0x7FFF_FFFF)  # per replica, per step
        input_ids = sample(train_data, batch_size, seq_len, gen)
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        info = diloco.step(loss=loss.item(), tokens=input_ids.numel())  # DiLoCo: the outer sync every H steps
        if info is not None:
            ctx.log.info("round %d: loss %.4f members %s sync %.2fs", info.round, info.loss or math.nan,
                         info.members, info.sync_s)
        if eval_every and ctx.rank == 0 and (step + 1) % eval_every == 0:
            diloco.report_eval(evaluate(model, eval_data, batch_size, seq_len, batches=4))
    eval_loss = evaluate(model, eval_data, batch_size, seq_len)
    digest = diloco.theta_digest()  # the global model's digest (every process adds its part): before close()
    diloco.close()  # DiLoCo
    result = {"rank": ctx.rank, "rounds": diloco.round, "eval_loss": eval_loss, "parameters": n_params,
              "wall_s": time.monotonic() - started, "theta_digest": digest}
    ctx.log.info("done: %s", json.dumps(result))
    if ctx.rank == 0:
        from diloco_replica.records.report import write_run_report

        write_run_report(ctx, diloco, eval_loss=eval_loss, steps=steps, n_params=n_params)
    return result
