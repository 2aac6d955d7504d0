"""The outer optimizer step, bit-reproducible on every host, and a digest of the state it keeps.

θ_global is never sent between replicas: agreement rests on every replica computing the very
same floats from the same decoded bytes. So the step is written as separate elementwise
operations, each one IEEE-rounded on its own: no fused multiply-add anywhere. torch's `add(x,
alpha=a)` and `addcmul` may be computed with an FMA in a vectorised loop and with a separate
multiply and add in its scalar tail, so the result of an element would depend on its offset
from a vector boundary, on how the tensor was sliced across threads, and on the CPU. A lone
multiply or add is exactly rounded whichever path computes it.
"""

from __future__ import annotations

import torch
import xxhash

from .finite import all_finite


# Elements per step of the update: its one temporary stays 1 MB, not a model-sized buffer. Small
# enough that the malloc arenas of the pool threads applying shards at once keep little of it;
# large enough that the loop's overhead is lost in the arithmetic. Chunking changes no result:
# every operation is elementwise and rounded on its own.
CHUNK = 1 << 18


def outer_step(theta: torch.Tensor, momentum_buf: torch.Tensor, grad: torch.Tensor, *, lr: float,
               momentum: float, nesterov: bool) -> bool:
    """SGD with (Nesterov) momentum, in place: torch.optim.SGD's update with dampening 0.

        buf ← momentum·buf + g;  u ← g + momentum·buf (Nesterov) or buf;  θ ← θ − lr·u

    Returns whether θ and the momentum are finite afterwards (an overflow), checked chunk by
    chunk while each chunk is still in cache, so the caller never publishes a non-finite θ.
    """
    finite = True
    for a in range(0, theta.numel(), CHUNK):
        t, b, g = theta[a:a + CHUNK], momentum_buf[a:a + CHUNK], grad[a:a + CHUNK]
        if momentum:
            b.mul_(momentum)
            b.add_(g)
            update = torch.mul(b, momentum).add_(g) if nesterov else b.clone()
        else:
            update = g.clone()
        t.sub_(update.mul_(lr))  # every operation rounded on its own
        finite = finite and all_finite(t) and all_finite(b)
    return finite


def state_digest(theta: torch.Tensor, momentum_buf: torch.Tensor) -> str:
    """XXH3-64 of θ_global's and the momentum's bytes: equal on every replica, or one diverged."""
    digest_theta = xxhash.xxh3_64_hexdigest(memoryview(theta.numpy()).cast("B"))
    digest_buf = xxhash.xxh3_64_hexdigest(memoryview(momentum_buf.numpy()).cast("B"))
    return f"{digest_theta}-{digest_buf}"
