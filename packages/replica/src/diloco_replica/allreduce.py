"""All-reduce through an object store: reduce-scatter then all-gather, each replica owning 1/N.

The store cannot add, so the replicas do the reduction (LambdaML's reduce-scatter through S3).
Round r, replica i with pseudo-gradient Δ_i split into N contiguous shards, shard j owned by j:

1. scatter: upload shard j of Δ_i to ``r/scatter/j/i`` for every j ≠ i, then a tiny
   ``r/ready/i`` marker (so "ready" implies all its shards are in the store);
2. membership (`membership.Membership`): one create-only ``members.json`` fixes who is in;
3. reduce: the reducer of shard j (j itself if it is a member, else the member at position
   j mod |members|) averages the members' contributions in rank order in fp32, encodes the mean
   with the transport codec and create-only puts ``r/reduced/j``. A contribution that fails its
   checksum twice is left out of that shard's mean, and the reduced object says so;
4. gather: download the other N−1 reduced shards. One that does not appear within the timeout
   (its reducer died) is taken over by exactly one waiting replica — whoever wins the
   create-only ``r/claim/j.<g>`` — while the rest keep waiting for its result; a claimant that
   dies too is replaced by generation g+1.

Every replica decodes the same reduced bytes (the reducer too), so the mean is bit-identical
everywhere. A reduced shard that is corrupt in the store is re-published by its reducer, which
keeps the bytes it wrote until its next round: a reader asks with ``r/repair/j`` and reads
``r/repaired/j``. Races with retention end in "use the published result" or `FellBehind`
(rejoin), never in an exception that costs a restart.

Per replica and round, with its shard reduced by itself: up S (N−1 shards out, one reduced
shard), down 2(N−1)/N·S — the ring all-reduce bound; O(N) requests.

With the `topk` transport a replica first sparsifies each shard of Δ + its error-feedback
residual (`codecs.sparsify`), keeps what it does not send in the residual, and contributes to
the mean exactly what the others decode from it; a reducer's mean is the union of its members'
supports, encoded sparse as well.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from diloco.spec import DILOCO
from diloco.store import ObjectExists, Store

from .codecs import sparsify
from .faults import CorruptionInjector, PhaseMarker
from .history import History
from .lanes import Lanes
from .membership import FellBehind, Membership, RoundFailed
from .transport import Backoff, CountingStore, LaneShards, RunKeys, Traffic, reducer_of, shard_bounds
from .wire import CorruptObject, Identity, decode_tensor, encode_tensor, pack, unpack

__all__ = ["FellBehind", "RoundFailed", "RoundResult", "StoreAllReduce"]
# A reducer watches for repair requests for round_timeout after publishing, backing off to one LIST
# per 30 s: ~20 LISTs a round on S3 for a fault that is rare; a reader asking waits at most that long.
REPAIR_POLL_CAP = 30.0


@dataclass
class RoundResult:
    round: int
    members: list[int]
    mean: torch.Tensor
    member: bool                    # whether this replica's update is in the mean
    traffic: Traffic
    seconds: float
    takeovers: list[int] = field(default_factory=list)
    incidents: list[dict[str, Any]] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)  # upload / wait / reduce / download seconds


class Laps:
    """Seconds spent in each named phase, measured back to back from one clock."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.monotonic()

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._last
        self._last = now


class StoreAllReduce:
    def __init__(self, store: Store, run_id: str, rank: int, world_size: int, *, codec: str = "fp32",
                 round_timeout: float = 300.0, min_members: int = 1, poll_interval: float = 0.05,
                 poll_max: float = 1.0, workers: int = 8, log: Callable[[str], None] | None = None,
                 lanes: Lanes | None = None, topk_density: float = DILOCO["topk_density"].default):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of {world_size}")
        self.store = CountingStore(store)
        self.keys = RunKeys(run_id)
        self.run_id, self.rank, self.n = run_id, rank, world_size
        self.lanes = lanes or Lanes()
        self.shards = LaneShards(self.lanes.index, world_size, self.lanes.count)
        self.sid = self.shards.sid  # shard j of this lane, as the store names it
        self.codec = codec
        self.topk_density = topk_density
        self.round_timeout = round_timeout
        self.poll_interval, self.poll_max = poll_interval, poll_max
        self.pool = ThreadPoolExecutor(max_workers=max(2, min(workers, 2 * world_size)))
        self.log = log or (lambda msg: None)
        self.phase = PhaseMarker(rank, self.lanes.index)
        self.corrupt = CorruptionInjector()
        self.history = History(self.store, self.keys, self.shards, self.pool, self.log)
        self.membership = Membership(self.store, self.keys, rank, world_size, self.history,
                                     round_timeout=round_timeout, min_members=min_members,
                                     poll_interval=poll_interval, poll_max=poll_max, log=self.log)
        self._published: dict[int, tuple[int, list]] = {}  # shard -> (round, blob) this replica last reduced
        self._cleanup_due: tuple[int, list[int], list[int]] | None = None
        self._watch_stop = threading.Event()
        self._watcher: threading.Thread | None = None

    # -- the round ---------------------------------------------------------------------------

    def run_round(self, r: int, delta: torch.Tensor, *, in_place: bool = False,
                  residual: torch.Tensor | None = None) -> RoundResult:
        """Take part in round `r` with `delta` (fp32, CPU, flat); return the members' mean.

        `in_place`: the mean is written over `delta` (shard j's slice of Δ is only read until
        shard j's mean is known), so a round holds one model-sized buffer, not two.
        `residual`: the topk transport's error feedback, as long as `delta`; added to Δ before
        sparsifying, and left holding what was not sent.
        """
        t0, before = time.monotonic(), self.store.traffic.snapshot()
        laps = Laps()
        delta = delta.detach().to("cpu", torch.float32).reshape(-1)
        bounds = shard_bounds(delta.numel(), self.n)
        members = self.lanes.on_leader(lambda: self._decided_or_open(r))
        if members is None:
            self.phase("upload", r)
            encoded = self._sparsify(delta, bounds, residual) if self.codec == "topk" else {}

            def upload() -> None:
                for f in [self.pool.submit(self._put_scatter, r, j, delta[a:b], encoded.get(j))
                          for j, (a, b) in enumerate(bounds) if j != self.rank]:
                    f.result()

            self.lanes.agree(upload)  # "ready" means every lane's shards are in the store
            laps.lap("upload")
            self.phase("membership", r)
            members = self.lanes.on_leader(lambda: self._ready_and_decide(r))
        laps.lap("wait")
        # The previous round's reduced shards stay servable until this round is formed: a reader
        # that found one corrupt is still finishing that round, and this round waits for it.
        self._stop_watching()
        self._serve_repairs_once()  # late requests (e.g. from a replaying rejoiner)
        self._published.clear()
        member = self.rank in members
        if not member:
            self.log(f"round {r}: not a member (members {members}); this replica's update is left out")
        incidents: list[dict[str, Any]] = []
        mine = [j for j in range(self.n) if reducer_of(j, members) == self.rank] if member else []
        mean = delta if in_place else torch.empty_like(delta)
        if mine:
            self.phase("reduce", r)
        for j in mine:
            a, b = bounds[j]
            mean[a:b] = self._reduce_shard(r, j, bounds[j], members, delta, takeover=False, incidents=incidents)
        laps.lap("reduce")
        self.phase("gather", r)
        takeovers = self._gather(r, bounds, members, mean, set(mine), delta if member else None, incidents)
        self._run_cleanup()
        if mine:
            self._cleanup_due = (r, mine, members)  # inputs stay one round, for takeovers and repairs
            self._watch_repairs(r)
        laps.lap("download")
        return RoundResult(r, members, mean, member, self.store.traffic.since(before), time.monotonic() - t0,
                           takeovers, incidents, {"upload": 0.0, **laps.seconds})

    def _decided_or_open(self, r: int) -> list[int] | None:
        """Round r's members if already decided (we are late); None if it is open to join."""
        members = self.membership.read(r)
        if members is None:
            self.membership.check_not_collected(r)
        return members

    def _ready_and_decide(self, r: int) -> list[int]:
        """(Lane 0, once per replica) mark this replica ready, then fix the round's members."""
        self._put(self.keys.ready(r, self.rank), b"{}", create_only=True)
        return self.membership.decide(r)

    def fetch(self, r: int, numel: int) -> RoundResult:
        """Read round `r`'s result without contributing (replay, catching up)."""
        t0, before = time.monotonic(), self.store.traffic.snapshot()
        members = self.membership.read(r)
        if members is None:
            self.membership.check_not_collected(r)
            raise RoundFailed(f"round {r} has no membership record; it has not happened yet")
        mean = torch.empty(numel, dtype=torch.float32)
        incidents: list[dict[str, Any]] = []
        takeovers = self._gather(r, shard_bounds(numel, self.n), members, mean, set(), None, incidents,
                                 replay=True)
        return RoundResult(r, members, mean, False, self.store.traffic.since(before), time.monotonic() - t0,
                           takeovers, incidents)

    def round_complete(self, r: int) -> bool:
        """Whether every reduced shard of this lane for round `r` is in the store (one LIST request)."""
        return len(self._present(self.keys.reduced(r))) >= self.n

    def _present(self, prefix: str) -> set[int]:
        """This lane's shard indices among the objects under `prefix` (one LIST)."""
        return self.shards.mine(self.store.list_names(prefix))

    # -- steps -------------------------------------------------------------------------------

    def _put(self, key: str, data, *, create_only: bool = False) -> bool:
        try:
            self.store.put(key, data, create_only=create_only)
            return True
        except ObjectExists:
            return False

    def _sparsify(self, delta: torch.Tensor, bounds: list[tuple[int, int]],
                  residual: torch.Tensor | None) -> dict[int, list[memoryview]]:
        """topk: Δ (+ residual) → what is sent, shard by shard; Δ becomes exactly what readers decode.

        Returns each shard's encoded payload, so uploads do not encode twice.
        """
        encoded = {}
        for j, (a, b) in enumerate(bounds):
            part = delta[a:b]
            if residual is not None:
                part += residual[a:b]
            parts = encode_tensor(sparsify(part, self.topk_density), "topk")
            sent = decode_tensor(b"".join(parts), "topk", b - a)
            if residual is not None:
                torch.sub(part, sent, out=residual[a:b])
            part.copy_(sent)
            encoded[j] = parts
        return encoded

    def _put_scatter(self, r: int, owner: int, part: torch.Tensor, encoded: list[memoryview] | None = None) -> None:
        ident = Identity(self.run_id, r, "scatter", self.sid(owner), self.rank)
        encoded = encoded if encoded is not None else encode_tensor(part, self.codec)
        blob = pack(ident, encoded, codec=self.codec, numel=part.numel())
        self._put(self.keys.scatter(r, self.sid(owner), self.rank), blob)
        self.corrupt(self.store.store, self.keys.scatter(r, self.sid(owner), self.rank), "scatter", r, self.sid(owner),
                     self.rank)

    def _get_verified(self, key: str, ident: Identity):
        """(unpacked, None), (None, "missing") or (None, reason): a corrupt read is retried once,
        since a torn transfer heals on a second read and damage at rest does not."""
        for _ in range(2):
            blob = self.store.get(key)
            if blob is None:
                return None, "missing"
            try:
                return unpack(blob, ident, key), None
            except CorruptObject as exc:
                reason = str(exc)
        return None, reason

    def _reduce_shard(self, r: int, j: int, bound: tuple[int, int], members: list[int],
                      delta: torch.Tensor | None, *, takeover: bool, incidents: list[dict[str, Any]]) -> torch.Tensor:
        """Average shard j over `members`, publish it (create-only), return the decoded mean."""
        a, b = bound
        sources = [m for m in members if m != self.rank or delta is None]
        if takeover and j in sources and j != self.rank:
            sources.remove(j)  # a dead owner kept its own part of shard j locally: it is gone
        got = dict(zip(sources, self.pool.map(
            lambda m: self._get_verified(self.keys.scatter(r, self.sid(j), m),
                                         Identity(self.run_id, r, "scatter", self.sid(j), m)),
            sources)))
        total = torch.zeros(b - a, dtype=torch.float32)
        used, left_out = [], {}
        for m in members:
            if m == self.rank and delta is not None:
                total += delta[a:b]
            elif m in got:
                obj, problem = got[m]
                if obj is None:
                    if problem == "missing":
                        self.membership.check_not_collected(r)
                    published = self._published_or_none(r, j)
                    if published is not None:  # reduced (and inputs cleaned) while we looked: use that
                        return published
                    key = self.keys.scatter(r, self.sid(j), m)
                    left_out[str(m)] = problem
                    incidents.append({"round": r, "object": key, "writer": m, "problem": problem,
                                      "action": f"left out of shard {j}'s mean by rank {self.rank}"})
                    self.log(f"round {r}: {key} from rank {m} is {problem}; left out of shard {j}'s mean")
                    continue
                total += obj.tensor()
            else:
                continue
            used.append(m)
        if not used:
            raise RoundFailed(f"round {r}: no usable contribution to shard {j}")
        mean = total.div_(len(used))  # in place: one shard-sized buffer (same rounding as total / n)
        ident = Identity(self.run_id, r, "reduced", self.sid(j), -1)
        blob = pack(ident, encode_tensor(mean, self.codec), codec=self.codec, numel=b - a,
                    meta={"members": used, "left_out": left_out, "reducer": self.rank, "takeover": takeover})
        if self._put(self.keys.reduced(r, self.sid(j)), blob, create_only=True):
            self._published[j] = (r, blob)
            self.corrupt(self.store.store, self.keys.reduced(r, self.sid(j)), "reduced", r, self.sid(j))
            payload = blob[1] if len(blob) == 2 else b"".join(blob[1:])
            return decode_tensor(payload, self.codec, b - a)  # exactly what every reader decodes
        return self._read_reduced(r, j, members, incidents)  # someone else won: use theirs

    def _published_or_none(self, r: int, j: int) -> torch.Tensor | None:
        if self.store.get(self.keys.reduced(r, self.sid(j))) is None:
            return None
        return self._read_reduced(r, j, None, [])

    def _read_reduced(self, r: int, j: int, members: list[int] | None, incidents: list[dict[str, Any]]) -> torch.Tensor:
        """Shard j's published mean, verified; a corrupt one is replaced by its reducer's re-publication."""
        ident = Identity(self.run_id, r, "reduced", self.sid(j), -1)
        key = self.keys.reduced(r, self.sid(j))
        obj, problem = self._get_verified(key, ident)
        if obj is not None:
            return obj.tensor()
        if problem == "missing":
            self.membership.check_not_collected(r)  # deleted by retention: rejoin
            raise RoundFailed(f"{key} vanished")
        return self._repaired(r, j, key, problem, members, incidents)

    def _repaired(self, r: int, j: int, key: str, problem: str, members: list[int] | None,
                  incidents: list[dict[str, Any]]) -> torch.Tensor:
        ident = Identity(self.run_id, r, "reduced", self.sid(j), -1)
        members = members or self.membership.read(r) or []
        writer = reducer_of(j, members) if members else None
        self.log(f"round {r}: {problem}; asking its reducer (rank {writer}) to re-publish it")
        self._put(self.keys.repair(r, self.sid(j)), json.dumps({"by": self.rank, "problem": problem}).encode(),
                  create_only=True)
        deadline = time.monotonic() + self.round_timeout
        backoff = Backoff(self.poll_interval, self.poll_max)
        while True:
            obj, _ = self._get_verified(self.keys.repaired(r, self.sid(j)), ident)
            if obj is not None:
                incidents.append({"round": r, "object": key, "writer": writer, "problem": problem,
                                  "action": f"re-published by its reducer as {self.keys.repaired(r, self.sid(j))}"})
                return obj.tensor()
            if not backoff.sleep(deadline):
                self.membership.check_not_collected(r)
                raise RoundFailed(f"{key} is corrupt ({problem}) and its reducer (rank {writer}) did not re-publish "
                                  f"it within {self.round_timeout:g}s")

    def _gather(self, r: int, bounds: list[tuple[int, int]], members: list[int], out: torch.Tensor,
                have: set[int], delta: torch.Tensor | None, incidents: list[dict[str, Any]], *,
                replay: bool = False) -> list[int]:
        """Fill `out` with every reduced shard not in `have`; one replica takes over any that never appears.

        `replay`: the round is known complete, so a shard missing now was garbage-collected under
        us: rejoin at once (FellBehind) instead of waiting out the timeout.

        Each shard is fetched, verified and decoded into its slice of `out` on a pool thread,
        so checksums and copies overlap with waiting for the remaining shards.
        """
        prefix = self.keys.reduced(r)
        wanted = [j for j in range(self.n) if j not in have]
        taken_over: list[int] = []
        generation = {j: 0 for j in wanted}

        def fetch(j: int) -> None:
            a, b = bounds[j]
            out[a:b] = self._read_reduced(r, j, members, incidents)

        pending = []
        while wanted:
            deadline = time.monotonic() + self.round_timeout
            backoff = Backoff(self.poll_interval, self.poll_max)
            waited = False
            while wanted:
                with self.store.polling(waited):  # re-listing after a wait is a poll
                    present = self._present(prefix)
                pending += [self.pool.submit(fetch, j) for j in wanted if j in present]
                wanted = [j for j in wanted if j not in present]
                if wanted and replay:
                    self.membership.check_not_collected(r)
                if wanted and not backoff.sleep(deadline):
                    break
                waited = True
            for j in list(wanted):  # its reducer (or the last claimant) never published
                if not self._put(self.keys.claim(r, self.sid(j), generation[j]), str(self.rank).encode(),
                                 create_only=True):
                    generation[j] += 1  # someone else claimed it: wait for their result, then claim the next
                    continue
                self.log(f"round {r}: reduced shard {j} did not appear in {self.round_timeout:g}s; reducing it here")
                a, b = bounds[j]
                out[a:b] = self._reduce_shard(r, j, bounds[j], members, delta, takeover=True, incidents=incidents)
                taken_over.append(j)
                wanted.remove(j)
            if wanted and all(generation[j] > len(members) for j in wanted):
                raise RoundFailed(f"round {r}: reduced shards {wanted} never appeared")
        for f in pending:
            f.result()
        return taken_over

    # -- after the round ---------------------------------------------------------------------

    def _run_cleanup(self) -> None:
        """Delete the scatter inputs of the previous round this replica reduced (dead weight now)."""
        due, self._cleanup_due = self._cleanup_due, None
        if due is None:
            return
        r, owned, members = due
        keys = [self.keys.scatter(r, self.sid(j), m) for j in owned for m in members if m != self.rank]

        def delete_all() -> None:
            for key in keys:
                try:
                    self.store.delete(key)
                except Exception:  # best effort; a leftover object costs storage, not correctness
                    pass

        self.pool.submit(delete_all)

    def _serve_repairs_once(self) -> bool:
        """Re-publish shards readers found corrupt; True once nothing is left to watch."""
        by_round: dict[int, list[int]] = {}
        for j, (r, _) in self._published.items():
            by_round.setdefault(r, []).append(j)
        for r, shards in by_round.items():
            asked = self._present(self.keys.repair(r))
            for j in shards:
                if j in asked:  # the very bytes it published first: readers verify them the same way
                    _, blob = self._published.pop(j)
                    self._put(self.keys.repaired(r, self.sid(j)), blob, create_only=True)
                    self.log(f"round {r}: re-published reduced shard {j} (a reader found it corrupt)")
        return not self._published

    def _watch_repairs(self, r: int) -> None:
        """Until the next round is formed (or the timeout), answer repair requests for round r."""
        self._watch_stop = threading.Event()
        stop = self._watch_stop

        def watch() -> None:
            deadline = time.monotonic() + self.round_timeout
            delay = max(self.poll_interval, 0.05)
            while True:
                try:
                    with self.store.polling():  # a watch costs what the wait costs: polls
                        if self._serve_repairs_once():
                            return
                except Exception as exc:  # never let the watcher take the replica down
                    self.log(f"round {r}: repair watch failed: {exc}")
                remaining = deadline - time.monotonic()
                # waiting on the event, not sleeping: the next round stops the watch at once
                if remaining <= 0 or stop.wait(min(delay, remaining)):
                    return
                delay = min(delay * 1.5, max(self.poll_max, REPAIR_POLL_CAP))

        self._watcher = threading.Thread(target=watch, name=f"diloco-repairs-r{r}", daemon=True)
        self._watcher.start()

    def _stop_watching(self) -> None:
        self._watch_stop.set()
        if self._watcher is not None:
            self._watcher.join()
            self._watcher = None

    def close(self) -> None:
        self._stop_watching()
        self.pool.shutdown(wait=True)

    def describe(self) -> dict[str, Any]:
        return {"run": self.run_id, "rank": self.rank, "world_size": self.n, "codec": self.codec,
                "topk_density": self.topk_density,
                "lane": self.lanes.index, "lanes": self.lanes.count}
