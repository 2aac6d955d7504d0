"""θ_global and the outer optimizer's state: how a replica gets them, keeps them, and repairs them.

Every replica holds a CPU fp32 master copy of θ_global and the outer momentum and applies the
outer step itself (`outer.outer_step`, bit-reproducible), on bit-identical decoded inputs, so all
replicas stay identical without ever sending θ. A replica that starts, restarts, falls behind
the retained history, or learns that its state diverged from the others' loads the newest
usable checkpoint and replays the rounds after it (`history.History`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from .allreduce import StoreAllReduce
from .membership import FellBehind, RoundFailed
from .outer import outer_step, state_digest
from .transport import Backoff, reducer_of


class GlobalState:
    def __init__(self, allreduce: StoreAllReduce, *, lr: float, momentum: float, nesterov: bool,
                 checkpoint_every: int = 10, log: Callable[[str], None] | None = None):
        self.ar = allreduce
        self.history = allreduce.history
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov
        self.checkpoint_every = checkpoint_every
        self.log = log or (lambda msg: None)
        self.round = 0
        self.theta: torch.Tensor | None = None
        self.buf: torch.Tensor | None = None
        self.written: dict[int, list[int]] = {}  # checkpoint round -> shards this replica wrote

    # -- start -------------------------------------------------------------------------------

    def bootstrap(self, initial: torch.Tensor, *, below: int | None = None) -> int:
        """Adopt the run's global state (creating round 0 from `initial` if the run is new).

        `below`: only checkpoints older than this round are trusted (after a divergence).
        """
        numel = initial.numel()
        for _ in range(8):  # a checkpoint can vanish under GC between listing and loading
            usable = [c for c in self.history.complete() if below is None or c < below]
            if not usable:
                if self.history.low_water() > 0:
                    raise RoundFailed("no usable checkpoint is left in the store and the early rounds are gone")
                self._write_initial(initial)
                usable = [0]
            loaded = self.history.load(usable[-1], numel)
            if loaded is None:
                continue
            self.theta, self.buf = loaded
            self.round = usable[-1]
            try:
                replayed = self.catch_up()
            except FellBehind as exc:  # GC overtook the replay: start again from the newer checkpoint
                self.log(f"{exc}; reloading")
                continue
            self.log(f"joined at round {self.round} (checkpoint {usable[-1]}, replayed {replayed} rounds)")
            return self.round
        raise RoundFailed("could not load a checkpoint: they kept changing under this replica")

    def catch_up(self) -> int:
        """Apply every round completed after ours; returns how many were applied."""
        n = 0
        while self.ar.round_complete(self.round + 1):
            res = self.ar.fetch(self.round + 1, self.theta.numel())
            self.apply(res.round, res.mean, res.members)
            n += 1
        return n

    def _write_initial(self, initial: torch.Tensor) -> None:
        """Round 0: shard i from this replica; after a wait, any missing shard from here too.

        Create-only puts, so each shard has exactly one writer and everyone loads the same θ_0
        (replicas should seed their model init identically; if they did not, θ_0 is still one
        consistent state that all of them adopt). Only the shards still missing are written.
        """
        zeros = torch.zeros_like(initial)
        prefix = self.ar.keys.checkpoint(0)
        present = set(self.ar.store.list_names(prefix))
        if str(self.ar.rank) not in present:
            self.history.put_shard(0, self.ar.rank, initial, zeros)
        deadline = time.monotonic() + self.ar.round_timeout
        backoff = Backoff(self.ar.poll_interval, self.ar.poll_max)
        present = set(self.ar.store.list_names(prefix))
        while len(present) < self.ar.n and backoff.sleep(deadline):
            present = set(self.ar.store.list_names(prefix))
        for j in range(self.ar.n):
            if str(j) not in present:  # its owner never came: write it from here (create-only)
                self.history.put_shard(0, j, initial, zeros)

    # -- each round --------------------------------------------------------------------------

    def apply(self, r: int, mean_delta: torch.Tensor, members: list[int]) -> None:
        """The outer step for round r, then a checkpoint if this round is a checkpoint round."""
        if r != self.round + 1:
            raise RoundFailed(f"applying round {r} on top of round {self.round}")
        outer_step(self.theta, self.buf, mean_delta, lr=self.lr, momentum=self.momentum, nesterov=self.nesterov)
        self.round = r
        if r % self.checkpoint_every == 0:
            mine = [j for j in range(self.ar.n) if reducer_of(j, members) == self.ar.rank]
            for j in mine:
                self.history.put_shard(r, j, self.theta, self.buf, digest=self.digest())
            if mine:
                self.written[r] = mine
            if reducer_of(0, members) == self.ar.rank:  # one collector per checkpoint, off the hot path
                self.ar.pool.submit(self.history.collect_garbage, r)

    def digest(self) -> str:
        return state_digest(self.theta, self.buf)

    def repair_divergence(self, since: int, initial: torch.Tensor) -> int:
        """This replica's state left the others' at round `since`: void the checkpoints it wrote
        from then on, and reload from an older one (the others' state, replayed)."""
        tainted = sorted(c for c in self.written if c >= since)
        if tainted:
            self.history.void(tainted, f"written by rank {self.ar.rank}, whose state diverged at round {since}")
        self.written = {c: s for c, s in self.written.items() if c < since}
        return self.bootstrap(initial, below=since)
