"""The replica `bench/recovery.py` runs: DiLoCo over a model of a given size whose inner steps
cost little, so that a 1 GB model's rounds fit two CPU cores and the bench measures what a
relaunched replica reads and waits for, not its arithmetic.

The model is `megabytes` of fp32 in 64 MiB tensors (so it is cut into shards like a real one);
an inner step is one SGD step on a quadratic pulling each tensor to a per-replica target, and
`step_s` of sleep standing for a real step's compute (so rounds have a period to wait out).
"""

from __future__ import annotations

import resource
import time

import torch
from torch import nn

from diloco.bootstrap.context import ReplicaContext

CHUNK = 16 * 2**20  # fp32 values per tensor (64 MiB)


class Blob(nn.Module):
    def __init__(self, numel: int, seed: int):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        sizes = [CHUNK] * (numel // CHUNK) + ([numel % CHUNK] if numel % CHUNK else [])
        self.parts = nn.ParameterList(nn.Parameter(torch.randn(n, generator=gen) * 0.01) for n in sizes)


def train(ctx: ReplicaContext, megabytes: float = 100.0, steps: int = 40, lr: float = 0.1, step_s: float = 0.0) -> dict:
    from diloco_replica import DiLoCo

    torch.set_num_threads(1)
    model = Blob(int(megabytes * 2**20) // 4, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    ctx.log.info("model %.0f MB built", megabytes)  # bench/recovery.py times the process start to here
    diloco = DiLoCo(model, opt, ctx)  # a relaunched replica loads the global state here
    ctx.log.info("joined: starting at step %d (round %d)", diloco.global_step, diloco.round)
    started = time.monotonic()
    target = 0.1 * (ctx.rank + 1)
    for _ in diloco.steps(steps):
        with torch.no_grad():
            for p in model.parameters():
                p.grad = p - target  # d/dp of (p - target)² / 2
        opt.step()
        opt.zero_grad(set_to_none=True)
        time.sleep(step_s)
        diloco.step(loss=0.0, tokens=1)
    digest = diloco.theta_digest()
    diloco.close()
    return {"rank": ctx.rank, "rounds": diloco.round, "theta_digest": digest, "wall_s": time.monotonic() - started,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # Linux: KiB
