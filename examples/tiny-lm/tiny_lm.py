"""A tiny byte-level transformer LM trained with DiLoCo on the Python standard library's source.

Real data every machine has, no download: the stdlib's own .py files (sorted, capped), split by
file into train and a held-out eval set. Each replica samples its own batches from a generator
seeded by (seed, rank, global step), so a replica that restarts continues its data stream.

`train` is the entrypoint (`diloco run examples/tiny-lm/diloco.toml`). Rank 0 ends the run by
evaluating the global model on the held-out split and writing a summary and a loss-curve PNG to
the store's artifacts/, which `diloco run` copies next to the run's records.

With `processes_per_replica = L` (diloco-ddp.toml) each replica is L processes started by
torchrun: the usual `init_process_group()`, the model wrapped in DDP (or sharded with FSDP2's
`fully_shard`, `parallel = "fsdp"`), each process training on its 1/L of the replica's batch,
and the same `DiLoCo(model, opt, ctx)` call.
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
from torch import nn

from diloco.bootstrap.context import ReplicaContext


# -- data -------------------------------------------------------------------------------------

def stdlib_sources(root: Path) -> list[Path]:
    """The stdlib's .py files, sorted, without site-packages/ and the test suites. The skipped
    folders are pruned from the walk, not filtered after it: a Python's site-packages (torch and
    the rest) holds far more files than its stdlib, and walking it took most of a second of every
    replica's start."""
    found = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in ("site-packages", "test", "tests")]
        found += [Path(folder, name) for name in names if name.endswith(".py")]
    return sorted(found)


def load_corpus(max_bytes: int = 3_000_000, eval_fraction: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and eval byte tensors from the stdlib's .py files; the split is by file."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_sources(root)
    train, evals, total = [], [], 0
    for path in files:
        try:
            data = path.read_bytes()
        except OSError:
            continue
        bucket = evals if zlib.crc32(str(path.relative_to(root)).encode()) % 1000 < eval_fraction * 1000 else train
        bucket.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    as_tensor = lambda chunks: torch.frombuffer(bytearray(b"\n".join(chunks)), dtype=torch.uint8).long()  # noqa: E731
    return as_tensor(train), as_tensor(evals)


def batch(data: torch.Tensor, batch_size: int, context: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, data.numel() - context - 1, (batch_size,), generator=gen)
    idx = starts[:, None] + torch.arange(context + 1)
    window = data[idx]
    return window[:, :-1], window[:, 1:]


# -- model ------------------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 128, layers: int = 2, heads: int = 4, context: int = 64):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(context, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("mask", torch.triu(torch.full((context, context), float("-inf")), 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.tok(x) + self.pos[:t]
        for block in self.blocks:
            h = block(h, self.mask[:t, :t])
        return self.head(self.ln(h))


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


@torch.no_grad()
def evaluate(model: nn.Module, data: torch.Tensor, context: int, batches: int = 16, batch_size: int = 32) -> float:
    gen = torch.Generator().manual_seed(1234)
    model.eval()
    losses = [loss_of(model, *batch(data, batch_size, context, gen)).item() for _ in range(batches)]
    model.train()
    return sum(losses) / len(losses)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def build(seed: int, context: int, dim: int, layers: int) -> TinyLM:
    torch.manual_seed(seed)  # identical θ_0 on every replica
    return TinyLM(dim=dim, layers=layers, context=context)


# -- the entrypoint ---------------------------------------------------------------------------

def parallelize(model: TinyLM, parallel: str) -> nn.Module:
    """Inside a replica of several processes: DDP (replicated) or FSDP2 (sharded) over torchrun's group."""
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        model = model.cuda()
    dist.init_process_group("nccl" if cuda else "gloo")  # RANK, WORLD_SIZE, MASTER_* come from torchrun
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        return fully_shard(model)
    if parallel == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    raise ValueError(f"parallel must be 'ddp' or 'fsdp', got {parallel!r}")


def train(ctx: ReplicaContext, steps: int | None = None, batch_size: int = 16, context: int = 64, dim: int = 128,
          layers: int = 2, lr: float = 2e-3, warmup: int = 50, seed: int = 0, threads: int = 1,
          max_bytes: int = 3_000_000, parallel: str = "ddp", eval_every: int = 0,
          slow_ranks: list[int] | None = None) -> dict:
    """`steps`: inner steps per replica (default: the spec's [diloco] total_steps); `eval_every`:
    replica 0 evaluates the model on the held-out split every that many steps and reports it;
    `slow_ranks`: these replicas take twice as long per inner step (a sleep as long as the step),
    a stand-in for a slower GPU (bench/uneven.py)."""
    from diloco_replica import DiLoCo, inner_optimizer

    torch.set_num_threads(threads)
    train_data, eval_data = load_corpus(max_bytes)
    model = build(seed, context, dim, layers)
    if ctx.lanes > 1:
        model = parallelize(model, parallel)
    device = next(model.parameters()).device
    opt = inner_optimizer(model.parameters(), lr=lr)
    diloco = DiLoCo(model, opt, ctx)
    ctx.log.info("model %d parameters, %d train / %d eval bytes; starting at step %d (round %d)",
                 sum(p.numel() for p in model.parameters()), train_data.numel(), eval_data.numel(),
                 diloco.global_step, diloco.round)
    started = time.monotonic()
    steps = steps or diloco.total_steps or 600
    slow = ctx.rank in (slow_ranks or [])
    next_eval = eval_every
    for step in diloco.steps(steps):
        step_t0 = time.monotonic()
        gen = torch.Generator().manual_seed(hash((seed, ctx.rank, step)) & 0x7FFF_FFFF)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        x, y = batch(train_data, batch_size, context, gen)  # the replica's batch; this process's 1/L of it
        loss = loss_of(model, x[ctx.lane::ctx.lanes].to(device), y[ctx.lane::ctx.lanes].to(device))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if slow:
            time.sleep(time.monotonic() - step_t0)
        info = diloco.step(loss=loss.item(), tokens=batch_size * context // ctx.lanes)
        if info is not None:
            ctx.log.info("round %d: loss %.4f members %s%s sync %.2fs", info.round, info.loss or float("nan"),
                         info.members, "" if info.member else " (not a member)", info.sync_s)
        # every process of the replica (FSDP); `>=`: with round_seconds a round may end before H
        # steps and the global step then jumps to the next round's start
        if eval_every and ctx.rank == 0 and step + 1 >= next_eval:
            diloco.report_eval(evaluate(model, eval_data.to(device), context, batches=4))
            next_eval = (step + 1) // eval_every * eval_every + eval_every
    eval_loss = evaluate(model, eval_data.to(device), context)
    digest = diloco.theta_digest()  # every process of the replica adds its part: before close()
    diloco.close()
    result = {"rank": ctx.rank, "rounds": diloco.round, "eval_loss": eval_loss,
              "wall_s": time.monotonic() - started, "theta_digest": digest, "peak_rss_mb": peak_rss_mb()}
    ctx.log.info("done: %s", json.dumps(result))
    if ctx.rank == 0 and ctx.lane == 0:
        from diloco_replica.records.report import write_run_report

        write_run_report(ctx, diloco, eval_loss=eval_loss, steps=steps, n_params=sum(p.numel() for p in model.parameters()))
    return result


if __name__ == "__main__":  # a plain single-process run, no launcher: python tiny_lm.py
    os.environ.setdefault("DILOCO_RENDEZVOUS", Path("/tmp/tiny-lm-store").as_uri())
    print(train(ReplicaContext.from_env(), steps=100))


def peak_rss_mb() -> float | None:
    """This process's peak resident memory (Linux's VmHWM), MB; None where /proc has none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None
