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

from ..transport.finite import all_finite
from ..round.layout import BLOCK


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


def state_digest(theta: torch.Tensor, momentum_buf: torch.Tensor, start: int = 0) -> tuple[int, int]:
    """This lane's part of the state's digest: θ_global's and the momentum's, for the slice of the
    model starting at `start` (a multiple of `layout.BLOCK`, as every lane's is). `digest_of` the
    lanes' parts is equal on every replica, whatever its lane count, or one diverged."""
    return blocks_digest(theta, start), blocks_digest(momentum_buf, start)


def digest_of(parts: list[tuple[int, int]] | list[list[int]]) -> str:
    """The replica's digest from its lanes' parts (`state_digest`): Σ mod 2⁶⁴ of each."""
    theta, buf = (sum(p[i] for p in parts) % (1 << 64) for i in (0, 1))
    return f"{theta:016x}-{buf:016x}"


def blocks_digest(x: torch.Tensor, start: int) -> int:
    """Σ over the model's `BLOCK`-value blocks of XXH3-64(block bytes, seed = block index), mod 2⁶⁴:
    a sum, so lanes add theirs up in any order; per block, so it hashes at XXH3's speed."""
    raw = memoryview(x.numpy()).cast("B")
    first, step = start // BLOCK, 4 * BLOCK
    return sum(xxhash.xxh3_64_intdigest(raw[o:o + step], seed=first + i)
               for i, o in enumerate(range(0, raw.nbytes, step))) % (1 << 64)
