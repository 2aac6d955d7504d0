"""All-reduce through an object store: reduce-scatter then all-gather, each replica owning 1/N.

The store cannot add, so the replicas do the reduction (LambdaML's reduce-scatter through S3).
Round r, replica i with pseudo-gradient Δ_i split into N contiguous shards, shard j owned by j:

1. scatter: upload shard j of Δ_i to ``r/scatter/j/i`` for every j ≠ i, then a tiny
   ``r/ready/i`` marker (so "ready" implies all its shards are in the store);
2. membership: wait (with backoff) until all N are ready or ``round_timeout`` passes, then
   create-only put ``r/members.json``. The first writer wins and everyone reads the winner's
   list, so every shard is averaged over the same members. Fewer than ``min_replicas`` → error.
   A replica that arrives after the decision is *late*: its Δ is left out of this round;
3. reduce: the reducer of shard j (j itself if it is a member, else the member at position
   j mod |members|) averages the members' contributions in rank order in fp32, encodes the mean
   with the transport codec and create-only puts ``r/reduced/j``;
4. gather: download the other N−1 reduced shards. If one does not appear within the timeout
   (its reducer died after the decision), any waiting replica computes it from the scatter
   objects and create-only puts it — first writer wins, so all replicas still read the same bytes.

Every replica decodes the same reduced bytes (the reducer too), so the mean is bit-identical
everywhere. Per replica and round, with its shard reduced by itself: up S (N−1 shards out, one
reduced shard), down 2(N−1)/N·S — the ring all-reduce bound; O(N) requests.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from diloco.store import ObjectExists, Store

from .wire import CorruptObject, Identity, decode_tensor, encode_tensor, pack, unpack


class RoundFailed(Exception):
    """A round could not complete (too few replicas, or an object never appeared)."""


class FellBehind(RoundFailed):
    """This replica's round is older than the history the store still keeps: rejoin instead."""


@dataclass
class Traffic:
    """Object bytes and requests through the store, as the all-reduce layer counts them."""

    bytes_up: int = 0
    bytes_down: int = 0
    puts: int = 0
    gets: int = 0
    lists: int = 0
    deletes: int = 0

    def snapshot(self) -> Traffic:
        return Traffic(**self.__dict__)

    def since(self, before: Traffic) -> Traffic:
        return Traffic(**{k: getattr(self, k) - getattr(before, k) for k in self.__dict__})


class CountingStore:
    """Wraps the run's store; counts every byte and request the all-reduce makes."""

    def __init__(self, store: Store):
        self.store = store
        self.traffic = Traffic()

    def put(self, key: str, data: bytes | list[bytes | memoryview], *, create_only: bool = False) -> None:
        self.traffic.puts += 1
        parts = data if isinstance(data, list) else [data]
        self.traffic.bytes_up += sum(memoryview(x).nbytes for x in parts)
        self.store.put(key, data, create_only=create_only)

    def get(self, key: str) -> memoryview | None:
        self.traffic.gets += 1
        data = self.store.get(key)
        if data is not None:
            self.traffic.bytes_down += data.nbytes
        return data

    def list_names(self, prefix: str) -> list[str]:
        self.traffic.lists += 1
        return [m["path"][len(prefix):] for m in self.store.list(prefix)]

    def delete(self, key: str) -> None:
        self.traffic.deletes += 1
        self.store.delete(key)


@dataclass
class RoundResult:
    round: int
    members: list[int]
    mean: torch.Tensor
    late: bool
    traffic: Traffic
    seconds: float
    takeovers: list[int] = field(default_factory=list)


def shard_bounds(numel: int, n: int) -> list[tuple[int, int]]:
    """N contiguous, near-equal slices covering [0, numel)."""
    base, extra = divmod(numel, n)
    bounds, start = [], 0
    for j in range(n):
        end = start + base + (1 if j < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def reducer_of(shard: int, members: list[int]) -> int:
    return shard if shard in members else members[shard % len(members)]


class Backoff:
    """Waits that grow (×1.5 up to `cap`), so waiting costs O(log) requests, not a tight loop."""

    def __init__(self, first: float, cap: float = 1.0):
        self.delay, self.cap = first, cap

    def sleep(self, deadline: float) -> bool:
        """Sleep the next interval; False if the deadline has passed."""
        now = time.monotonic()
        if now >= deadline:
            return False
        time.sleep(min(self.delay, deadline - now))
        self.delay = min(self.delay * 1.5, self.cap)
        return True


class PhaseMarker:
    """Fault-injection aid: announces which phase of a round a replica is in.

    With DILOCO_FAULT_PHASE_FILE set (``{rank}`` is replaced), each phase's name is written
    there as it starts, and DILOCO_FAULT_PHASE_DELAY seconds are slept, so a test harness can
    aim SIGKILLs at uploads, reductions and gathers and record where each kill landed. Off (no
    cost beyond one attribute check) unless the variable is set.
    """

    def __init__(self, rank: int):
        import os

        template = os.environ.get("DILOCO_FAULT_PHASE_FILE")
        self.path = template.replace("{rank}", str(rank)) if template else None
        self.delay = float(os.environ.get("DILOCO_FAULT_PHASE_DELAY") or 0)

    def __call__(self, phase: str, r: int) -> None:
        if self.path is None:
            return
        with open(self.path, "w") as f:
            f.write(f"{phase} {r}\n")
        if self.delay:
            time.sleep(self.delay)


class StoreAllReduce:
    def __init__(self, store: Store, run_id: str, rank: int, world_size: int, *, codec: str = "fp32",
                 round_timeout: float = 300.0, min_replicas: int = 1, poll_interval: float = 0.05,
                 poll_max: float = 1.0, workers: int = 8, log: Callable[[str], None] | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of {world_size}")
        self.store = CountingStore(store)
        self.run_id, self.rank, self.n = run_id, rank, world_size
        self.codec = codec
        self.round_timeout = round_timeout
        self.min_replicas = min_replicas
        self.poll_interval, self.poll_max = poll_interval, poll_max
        self.pool = ThreadPoolExecutor(max_workers=max(2, min(workers, 2 * world_size)))
        self.log = log or (lambda msg: None)
        self.phase = PhaseMarker(rank)

    # -- keys --------------------------------------------------------------------------------

    def _round(self, r: int) -> str:
        return f"{self.run_id}/r{r:08d}"

    def scatter_key(self, r: int, owner: int, src: int) -> str:
        return f"{self._round(r)}/scatter/{owner}/{src}"

    def reduced_key(self, r: int, owner: int) -> str:
        return f"{self._round(r)}/reduced/{owner}"

    # -- the round ---------------------------------------------------------------------------

    def reduce(self, r: int, delta: torch.Tensor) -> RoundResult:
        """Average `delta` (fp32, CPU, flat) with whoever joins round `r`."""
        t0, before = time.monotonic(), self.store.traffic.snapshot()
        delta = delta.detach().to("cpu", torch.float32).reshape(-1)
        bounds = shard_bounds(delta.numel(), self.n)
        existing = self._read_members(r)
        if existing is None and r > 1 and self._read_members(r - 1) is None:
            # At the frontier the previous round is always kept; a missing one means old rounds were
            # garbage-collected past this replica. Deciding round r here would rewrite history.
            raise FellBehind(f"round {r - 1} is no longer in the store; this replica is too far behind")
        if existing is None:
            self.phase("upload", r)
            uploads = [self.pool.submit(self._put_scatter, r, j, delta[a:b])
                       for j, (a, b) in enumerate(bounds) if j != self.rank]
            for f in uploads:
                f.result()
            self._put(f"{self._round(r)}/ready/{self.rank}", b"{}", create_only=True)
            self.phase("membership", r)
            members = self._decide_members(r)
        else:
            members = existing
        late = self.rank not in members
        if late:
            self.log(f"round {r}: late (members {members}); this replica's update is left out")
        mine = [j for j in range(self.n) if reducer_of(j, members) == self.rank] if not late else []
        mean = torch.empty_like(delta)
        if mine:
            self.phase("reduce", r)
        for j in mine:
            a, b = bounds[j]
            mean[a:b] = self._reduce_shard(r, j, bounds[j], members, delta, takeover=False)
        self.phase("gather", r)
        takeovers = self._gather(r, bounds, members, mean, set(mine), delta if not late else None)
        if mine and not late:
            self.pool.submit(self._cleanup_inputs, r, mine, members)
        return RoundResult(r, members, mean, late, self.store.traffic.since(before), time.monotonic() - t0,
                           takeovers)

    def fetch(self, r: int, numel: int) -> RoundResult:
        """Read round `r`'s result without contributing (replay, catching up)."""
        t0, before = time.monotonic(), self.store.traffic.snapshot()
        members = self._read_members(r)
        if members is None:
            raise RoundFailed(f"round {r} has no membership record; it has not happened yet")
        mean = torch.empty(numel, dtype=torch.float32)
        takeovers = self._gather(r, shard_bounds(numel, self.n), members, mean, set(), None)
        return RoundResult(r, members, mean, True, self.store.traffic.since(before), time.monotonic() - t0, takeovers)

    def round_complete(self, r: int) -> bool:
        """Whether every reduced shard of round `r` is in the store (one LIST request)."""
        return len(self.store.list_names(f"{self._round(r)}/reduced/")) >= self.n

    # -- steps -------------------------------------------------------------------------------

    def _put(self, key: str, data: bytes, *, create_only: bool = False) -> bool:
        try:
            self.store.put(key, data, create_only=create_only)
            return True
        except ObjectExists:
            return False

    def _put_scatter(self, r: int, owner: int, part: torch.Tensor) -> None:
        ident = Identity(self.run_id, r, "scatter", owner, self.rank)
        blob = pack(ident, encode_tensor(part, self.codec), codec=self.codec, numel=part.numel())
        self._put(self.scatter_key(r, owner, self.rank), blob)

    def _read_members(self, r: int) -> list[int] | None:
        key = f"{self._round(r)}/members.json"
        raw = self.store.get(key)
        if raw is None:
            return None
        try:
            data = json.loads(bytes(raw))
            members = [int(m) for m in data["members"]]
            if data.get("run") != self.run_id or data.get("round") != r:
                raise ValueError(f"written for run {data.get('run')!r} round {data.get('round')}")
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptObject(f"{key}: invalid membership record: {exc}") from None
        return members

    def _decide_members(self, r: int) -> list[int]:
        deadline = time.monotonic() + self.round_timeout
        backoff = Backoff(self.poll_interval, self.poll_max)
        prefix = f"{self._round(r)}/ready/"
        while True:
            ready = sorted(int(x) for x in self.store.list_names(prefix) if x.isdigit() and int(x) < self.n)
            if len(ready) == self.n:
                break
            decided = self._read_members(r) if len(ready) > 1 else None
            if decided is not None:
                return decided
            if not backoff.sleep(deadline):
                break
        if len(ready) < self.min_replicas:
            raise RoundFailed(f"round {r}: only {len(ready)} of {self.n} replicas ready within "
                              f"{self.round_timeout:g}s, below min_replicas={self.min_replicas}")
        record = json.dumps({"run": self.run_id, "round": r, "members": ready, "decided_by": self.rank}).encode()
        if not self._put(f"{self._round(r)}/members.json", record, create_only=True):
            return self._read_members(r) or ready
        if len(ready) < self.n:
            self.log(f"round {r}: proceeding with {len(ready)} of {self.n} replicas {ready} after "
                     f"{self.round_timeout:g}s")
        return ready

    def _reduce_shard(self, r: int, j: int, bound: tuple[int, int], members: list[int],
                      delta: torch.Tensor | None, *, takeover: bool) -> torch.Tensor:
        """Average shard j over `members`, publish it (create-only), return the decoded mean."""
        a, b = bound
        sources = [m for m in members if m != self.rank or delta is None]
        if takeover and j in sources and j != self.rank:
            sources.remove(j)  # a dead owner kept its own part of shard j locally: it is gone
        blobs = dict(zip(sources, self.pool.map(lambda m: self.store.get(self.scatter_key(r, j, m)), sources)))
        total = torch.zeros(b - a, dtype=torch.float32)
        count = 0
        used = []
        for m in members:
            if m == self.rank and delta is not None:
                total += delta[a:b]
            elif m in blobs:
                key = self.scatter_key(r, j, m)
                if blobs[m] is None:
                    raise RoundFailed(f"{key} is missing although rank {m} is a member of round {r}")
                total += unpack(blobs[m], Identity(self.run_id, r, "scatter", j, m), key).tensor()
            else:
                continue
            count += 1
            used.append(m)
        mean = total / count
        ident = Identity(self.run_id, r, "reduced", j, -1)
        blob = pack(ident, encode_tensor(mean, self.codec), codec=self.codec, numel=b - a,
                    meta={"members": used, "reducer": self.rank, "takeover": takeover})
        key = self.reduced_key(r, j)
        if self._put(key, blob, create_only=True):
            payload = blob[1] if len(blob) == 2 else b"".join(blob[1:])
            return decode_tensor(payload, self.codec, b - a)  # exactly what every reader decodes
        return self._read_reduced(r, j, self.store.get(key))  # someone else won: use theirs

    def _read_reduced(self, r: int, j: int, blob: memoryview | None) -> torch.Tensor:
        key = self.reduced_key(r, j)
        if blob is None:
            raise RoundFailed(f"{key} vanished")
        return unpack(blob, Identity(self.run_id, r, "reduced", j, -1), key).tensor()

    def _gather(self, r: int, bounds: list[tuple[int, int]], members: list[int], out: torch.Tensor,
                have: set[int], delta: torch.Tensor | None) -> list[int]:
        """Fill `out` with every reduced shard not in `have`; take over any that never appears.

        Each shard is fetched, verified and decoded into its slice of `out` on a pool thread,
        so checksums and copies overlap with waiting for the remaining shards.
        """
        prefix = f"{self._round(r)}/reduced/"
        wanted = [j for j in range(self.n) if j not in have]
        deadline = time.monotonic() + self.round_timeout
        backoff = Backoff(self.poll_interval, self.poll_max)

        def fetch(j: int) -> None:
            a, b = bounds[j]
            out[a:b] = self._read_reduced(r, j, self.store.get(self.reduced_key(r, j)))

        pending = []
        while wanted:
            present = {int(x) for x in self.store.list_names(prefix) if x.isdigit()}
            ready = [j for j in wanted if j in present]
            pending += [self.pool.submit(fetch, j) for j in ready]
            wanted = [j for j in wanted if j not in present]
            if wanted and not backoff.sleep(deadline):
                break
        for f in pending:
            f.result()
        for j in wanted:
            self.log(f"round {r}: reduced shard {j} did not appear in {self.round_timeout:g}s; "
                     f"reducing it here")
            a, b = bounds[j]
            out[a:b] = self._reduce_shard(r, j, bounds[j], members, delta, takeover=True)
        return wanted

    def _cleanup_inputs(self, r: int, owned: Iterable[int], members: list[int]) -> None:
        """Scatter inputs are dead weight once their shard is reduced: delete them."""
        for j in owned:
            for m in members:
                if m != self.rank:
                    try:
                        self.store.delete(self.scatter_key(r, j, m))
                    except Exception:  # best effort; a leftover object costs storage, not correctness
                        pass

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    def describe(self) -> dict[str, Any]:
        return {"run": self.run_id, "rank": self.rank, "world_size": self.n, "codec": self.codec}
