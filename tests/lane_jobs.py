"""Training functions for the process-group tests: the tiny LM under DDP or FSDP2 in each replica.

The loop is the example's (examples/tiny-lm/tiny_lm.py: its model, data and `parallelize`), plus
a trace: after every round each process hashes the *whole* model it holds (FSDP2: the full
tensors, gathered) and writes its hashes, eval loss and peak RSS to `trace_dir`, so a test can
check every process of every replica, not only what process 0 reports.
"""

from __future__ import annotations

import json
import resource
import zlib
from pathlib import Path

import torch

from diloco.bootstrap.context import ReplicaContext


def whole_model_crc(model: torch.nn.Module) -> str:
    crc = 0
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP2 DTensor: gather (collective)
        crc = zlib.crc32(full.detach().to("cpu", torch.float32).contiguous().numpy().tobytes(), crc)
    return f"{crc:08x}"


def train_traced(ctx: ReplicaContext, trace_dir: str, steps: int = 40, batch_size: int = 16, context: int = 64,
                 dim: int = 64, layers: int = 1, lr: float = 2e-3, parallel: str = "ddp", seed: int = 0) -> dict:
    from tiny_lm import batch, build, evaluate, load_corpus, loss_of, parallelize

    from diloco_replica import DiLoCo, inner_optimizer

    torch.set_num_threads(1)
    train_data, eval_data = load_corpus(600_000)
    model = build(seed, context, dim, layers)
    if ctx.lanes > 1:
        model = parallelize(model, parallel)
    opt = inner_optimizer(model.parameters(), lr=lr)
    diloco = DiLoCo(model, opt, ctx)
    hashes: dict[int, str] = {}
    for step in diloco.steps(steps):
        gen = torch.Generator().manual_seed(hash((seed, ctx.rank, step)) & 0x7FFF_FFFF)
        x, y = batch(train_data, batch_size, context, gen)
        loss = loss_of(model, x[ctx.lane::ctx.lanes], y[ctx.lane::ctx.lanes])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        info = diloco.step(loss=loss.item(), tokens=batch_size * context // ctx.lanes)
        if info is not None:
            hashes[info.round] = whole_model_crc(model)
    eval_loss = evaluate(model, eval_data, context)
    final = whole_model_crc(model)
    diloco.close()
    out = {"rank": ctx.rank, "lane": ctx.lane, "attempt": ctx.attempt, "hashes": hashes, "final": final,
           "eval_loss": eval_loss, "rounds": diloco.round, "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}
    Path(trace_dir, f"rank{ctx.rank}-lane{ctx.lane}-attempt{ctx.attempt}.json").write_text(json.dumps(out))
    return out
