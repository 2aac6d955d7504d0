"""A round a shard at a time: where Δ comes from, where each mean goes, and how much is in flight.

A round used to hold its pseudo-gradient Δ and the mean as one model-sized buffer on top of
θ_global and the momentum, and to download every contribution to a shard before averaging:
4.6× the fp32 model of host memory at 100 MB. Streamed, it holds θ_global, the momentum and a
few shards (and, in a sync process, the round's snapshot: the local parameters, then Δ written
over them in place):

- **Δ, a shard at a time** (`DeltaSource`): the all-reduce asks for Δ[a:b] when shard j is
  encoded and uploaded, or contributed to its own mean; `LiveDelta` computes each slice on
  demand from θ_global and θ_local, and the slice is freed after (`WholeDelta` holds it whole:
  a sync process's snapshot, overwritten with Δ by `exchanger`).
- **Each mean where it goes** (`RoundSink`): the reducers' means reach the caller one shard at a
  time, as they arrive; the exchanger applies the outer step to that slice of θ_global and the
  momentum in place, so no mean buffer exists.
- **A window** (`Window`): at most `window` shards are being encoded, uploaded, downloaded or
  folded at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

import torch

from ..transport.wire import CorruptObject

# A sink receives shard j's mean: (shard index, start, stop within the round's vector, values).
RoundSink = Callable[[int, int, int, torch.Tensor], None]
# Where a round reads θ_local from when no snapshot is taken: (start, stop within the round's
# fragment of the lane, an fp32 vector of that length to fill, on the host or the model's device).
LocalReader = Callable[[int, int, torch.Tensor], None]


class DeltaSource(Protocol):
    """Δ of one round, readable a slice at a time."""

    numel: int

    def shard(self, a: int, b: int, device: torch.device | None = None) -> torch.Tensor:
        """Δ[a:b] as fp32, computed on `device` where the source can (default: the host). May be
        a view (`WholeDelta`, on the host) the caller may modify."""


class LiveDelta:
    """Δ = θ_global − θ_local computed a slice at a time when asked, θ_local read where it is (the
    model's parameters while the training loop waits for the round, or the device copy an
    overlapped round keeps for its merge): the host holds no snapshot of the lane, only the slices
    in flight. Each slice is the same one fp32 subtraction as over the whole vector, so the bits
    are the same. A slice must be read before its mean reaches θ_global, which a round's order
    gives: a piece is uploaded before the round's members are known, and a reducer folds its own
    piece (or a taken-over shard's) before it hands the mean on."""

    def __init__(self, theta: torch.Tensor, read_local: LocalReader):
        self.theta, self.read_local = theta, read_local
        self.numel = theta.numel()

    def shard(self, a: int, b: int, device: torch.device | None = None) -> torch.Tensor:
        """On `device` (the round's `codecdevice`, where θ_local is), θ_global's slice goes there and
        θ_local's never leaves: the same one subtraction, without θ_local's trip to the host."""
        out = torch.empty(b - a, device=device)
        self.read_local(a, b, out)
        return torch.sub(self.theta[a:b].to(out.device), out, out=out)


class WholeDelta:
    """Δ held whole: slices are views into it."""

    def __init__(self, delta: torch.Tensor):
        self.delta = delta
        self.numel = delta.numel()

    def shard(self, a: int, b: int, device: torch.device | None = None) -> torch.Tensor:
        return self.delta[a:b]  # on the host, whatever `device`: the caller moves it


def buffer_sink(out: torch.Tensor) -> RoundSink:
    """A sink that writes each mean into its slice of `out` (the whole-vector form)."""

    def sink(j: int, a: int, b: int, values: torch.Tensor) -> None:
        out[a:b] = values

    return sink


def pool_width(n: int) -> int:
    """Requests a replica has in flight at once: 8, and N/4 from N = 32 on (up to 64), so the
    window below can grow with N: at N = 256 a phase is 4 waves of 64 requests, not 32 waves of 8
    (bench/scale.py: 2.6× the round time of N = 8 at N = 128 with 8)."""
    return max(8, min(64, n // 4))


def window_for(n: int, workers: int) -> int:
    """Shards in flight at once: N/4 of them (a quarter of the model at most, so DiLoCo adds
    θ_global + momentum + ~0.5× at any N), at least one, at most the pool's width: while shards
    are large (N small) memory decides; as they get small the round is latency-bound and
    parallel requests decide."""
    return max(1, min(workers, n // 4))


class Prefetch:
    """Downloads in a fixed order, at most `window` held at once — the one being used and
    `window` − 1 started ahead of it — so a reducer folds contributions as they arrive without
    holding all N−1 of them."""

    def __init__(self, pool, fetch: Callable, order: list, window: int):
        self.pool, self.fetch, self.ahead = pool, fetch, max(0, window - 1)
        self.queue, self.running = list(order), []
        self._fill(self.ahead)

    def _fill(self, limit: int) -> None:
        while self.queue and len(self.running) < limit:
            item = self.queue.pop(0)
            self.running.append((item, self.pool.submit(self.fetch, item)))

    def next(self, item):
        """The download of `item` (the next in order), once done; the next ones start meanwhile."""
        if not self.running:
            self._fill(1)
        got, future = self.running.pop(0)
        if got != item:
            raise RuntimeError(f"prefetch out of order: {got} before {item}")
        self._fill(self.ahead)
        return future.result()

    def cancel(self) -> None:
        for _, future in self.running:
            future.cancel()
        self.running, self.queue = [], []


class Window:
    """A counting gate: `with gate:` around the work on one shard keeps at most `limit` open (or
    `acquire()` before handing the work to a pool and `release()` when it is done)."""

    def __init__(self, limit: int):
        self._sem = threading.BoundedSemaphore(max(1, limit))

    def acquire(self) -> None:
        self._sem.acquire()

    def release(self) -> None:
        self._sem.release()

    def __enter__(self) -> Window:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class ReadOnceThenRefetch:
    """A verified contribution: the first read decodes the downloaded object and lets it go (the
    fold holds one at a time); a second read — only on the slow path, to find which member's
    values are non-finite — downloads it again. Decoded on `device` (the round's `codecdevice`)."""

    def __init__(self, obj, refetch: Callable[[], tuple], device: torch.device | None = None):
        self.obj, self.refetch, self.device = obj, refetch, device

    def read(self) -> torch.Tensor:
        obj, self.obj = self.obj, None
        if obj is None:
            obj, problem = self.refetch()
            if obj is None:
                raise CorruptObject(f"re-read for the non-finite check: {problem}")
        return obj.tensor(self.device)
