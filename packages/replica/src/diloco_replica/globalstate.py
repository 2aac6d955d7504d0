"""θ_global and the outer optimizer's state: how a replica gets them, keeps them, and shares them.

Every replica holds a CPU fp32 master copy of θ_global and the outer momentum and applies the
outer step itself. The step is elementwise fp32 CPU arithmetic on bit-identical inputs (every
replica decodes the same reduced bytes), so all replicas stay bit-identical without ever
sending θ.

For (re)joining, the store holds:
- checkpoints every `checkpoint_every` rounds at ``ckpt/r<round>/<j>``: shard j of
  [θ_global ; momentum] in fp32, written by shard j's reducer (so N writers, S·2/N each);
  round 0 is the initial state, written before training starts;
- the reduced shards of every round since (the all-reduce leaves them there).
A replica that starts or restarts loads the newest complete checkpoint and replays the rounds
after it, arriving bit-identical to the others at the latest completed round.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from diloco.store import ObjectExists

from .allreduce import Backoff, RoundFailed, StoreAllReduce, reducer_of, shard_bounds
from .wire import Identity, encode_tensor, pack, unpack


def outer_step(theta: torch.Tensor, momentum_buf: torch.Tensor, grad: torch.Tensor, *, lr: float,
               momentum: float, nesterov: bool) -> None:
    """SGD with (Nesterov) momentum, in place; torch.optim.SGD's update, dampening 0."""
    if momentum:
        momentum_buf.mul_(momentum).add_(grad)
        update = grad.add(momentum_buf, alpha=momentum) if nesterov else momentum_buf
    else:
        update = grad
    theta.sub_(update, alpha=lr)


class GlobalState:
    def __init__(self, allreduce: StoreAllReduce, *, lr: float, momentum: float, nesterov: bool,
                 checkpoint_every: int = 10, log: Callable[[str], None] | None = None):
        self.ar = allreduce
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov
        self.checkpoint_every = checkpoint_every
        self.log = log or (lambda msg: None)
        self.round = 0
        self.theta: torch.Tensor | None = None
        self.buf: torch.Tensor | None = None

    # -- keys --------------------------------------------------------------------------------

    def _ckpt_prefix(self, r: int) -> str:
        return f"{self.ar.run_id}/ckpt/r{r:08d}/"

    # -- start -------------------------------------------------------------------------------

    def bootstrap(self, initial: torch.Tensor) -> int:
        """Adopt the run's global state (creating round 0 from `initial` if the run is new)."""
        numel = initial.numel()
        latest = self._latest_complete_checkpoint()
        if latest is None:
            self._write_initial(initial)
            latest = 0
        self._load_checkpoint(latest, numel)
        replayed = self.catch_up()
        self.log(f"joined at round {self.round} (checkpoint {latest}, replayed {replayed} rounds)")
        return self.round

    def catch_up(self) -> int:
        """Apply every round completed after ours; returns how many were applied."""
        n = 0
        while self.ar.round_complete(self.round + 1):
            res = self.ar.fetch(self.round + 1, self.theta.numel())
            self.apply(res.round, res.mean, res.members)
            n += 1
        return n

    def _latest_complete_checkpoint(self) -> int | None:
        complete = self._complete_checkpoints()
        return complete[-1] if complete else None

    def _write_initial(self, initial: torch.Tensor) -> None:
        """Round 0: shard i from this replica; after a wait, any missing shard from here too.

        Create-only puts, so each shard has exactly one writer and everyone loads the same θ_0
        (replicas should seed their model init identically; if they did not, θ_0 is still one
        consistent state that all of them adopt).
        """
        zeros = torch.zeros_like(initial)
        bounds = shard_bounds(initial.numel(), self.ar.n)
        self._put_ckpt(0, self.ar.rank, initial, zeros, bounds)
        deadline = time.monotonic() + self.ar.round_timeout
        backoff = Backoff(self.ar.poll_interval, self.ar.poll_max)
        present = set(self.ar.store.list_names(self._ckpt_prefix(0)))
        while len(present) < self.ar.n and backoff.sleep(deadline):
            present = set(self.ar.store.list_names(self._ckpt_prefix(0)))
        for j in range(self.ar.n):
            if str(j) not in present:  # its owner never came: write it from here (create-only)
                self._put_ckpt(0, j, initial, zeros, bounds)

    def _put_ckpt(self, r: int, j: int, theta: torch.Tensor, buf: torch.Tensor,
                  bounds: list[tuple[int, int]]) -> None:
        a, b = bounds[j]
        part = torch.cat([theta[a:b], buf[a:b]])
        blob = pack(Identity(self.ar.run_id, r, "ckpt", j, -1), encode_tensor(part, "fp32"), codec="fp32",
                    numel=part.numel(), meta={"numel": theta.numel()})
        try:
            self.ar.store.put(self._ckpt_prefix(r) + str(j), blob, create_only=True)
        except ObjectExists:
            pass

    def _load_checkpoint(self, r: int, numel: int) -> None:
        bounds = shard_bounds(numel, self.ar.n)
        keys = [self._ckpt_prefix(r) + str(j) for j in range(self.ar.n)]
        blobs = list(self.ar.pool.map(self.ar.store.get, keys))
        theta, buf = torch.empty(numel), torch.empty(numel)
        for j, (key, blob) in enumerate(zip(keys, blobs)):
            if blob is None:
                raise RoundFailed(f"checkpoint shard {key} vanished")
            got = unpack(blob, Identity(self.ar.run_id, r, "ckpt", j, -1), key)
            if got.meta.get("numel") != numel:
                raise RoundFailed(f"{key} holds a model of {got.meta.get('numel')} parameters, this replica "
                                  f"has {numel}: the rendezvous store belongs to a different model")
            a, b = bounds[j]
            part = got.tensor()
            theta[a:b], buf[a:b] = part[: b - a], part[b - a:]  # copies out of the downloaded buffer
        self.theta, self.buf, self.round = theta, buf, r

    # -- each round --------------------------------------------------------------------------

    def apply(self, r: int, mean_delta: torch.Tensor, members: list[int]) -> None:
        """The outer step for round r, then a checkpoint if this round is a checkpoint round."""
        if r != self.round + 1:
            raise RoundFailed(f"applying round {r} on top of round {self.round}")
        outer_step(self.theta, self.buf, mean_delta, lr=self.lr, momentum=self.momentum, nesterov=self.nesterov)
        self.round = r
        if r % self.checkpoint_every == 0:
            bounds = shard_bounds(self.theta.numel(), self.ar.n)
            for j in range(self.ar.n):
                if reducer_of(j, members) == self.ar.rank:
                    self._put_ckpt(r, j, self.theta, self.buf, bounds)
            if reducer_of(0, members) == self.ar.rank:  # one collector per checkpoint, off the hot path
                self.ar.pool.submit(self.collect_garbage, r)

    def collect_garbage(self, newest: int) -> int:
        """Delete what no rejoin can need any more; returns how many objects went.

        A rejoining replica loads the newest *complete* checkpoint and replays the rounds after
        it. So once checkpoint p < `newest` is complete, rounds ≤ p and checkpoints < p are dead
        weight (p, not `newest`: `newest` may still be missing a shard whose writer died).
        Without this the store grows by ~S per round for as long as the run lasts.
        """
        try:
            complete = self._complete_checkpoints()
            older = [c for c in complete if c < newest]
            if not older:
                return 0
            keep_from = max(older)
            raw, run = self.ar.store.store, self.ar.run_id
            doomed = [d for d in raw.list_dirs(f"{run}/") if _round_of(d.rsplit("/", 1)[-1], keep_from + 1)]
            doomed += [d for d in raw.list_dirs(f"{run}/ckpt/") if _round_of(d.rsplit("/", 1)[-1], keep_from)]
            n = 0
            for prefix in doomed:
                for meta in list(raw.list(prefix + "/")):
                    self.ar.store.delete(meta["path"])
                    n += 1
            if n:
                self.log(f"removed {n} objects of rounds before checkpoint {keep_from}")
            return n
        except Exception as exc:  # storage hygiene must never stop training
            self.log(f"garbage collection after round {newest} failed: {exc}")
            return 0

    def _complete_checkpoints(self) -> list[int]:
        counts: dict[int, int] = {}
        for name in self.ar.store.list_names(f"{self.ar.run_id}/ckpt/"):
            head = name.split("/")[0]
            if head.startswith("r") and head[1:].isdigit():
                counts[int(head[1:])] = counts.get(int(head[1:]), 0) + 1
        return sorted(r for r, c in counts.items() if c >= self.ar.n)


def _round_of(name: str, below: int) -> bool:
    """Whether a directory named r<round> holds a round older than `below`."""
    return name.startswith("r") and name[1:].isdigit() and int(name[1:]) < below
