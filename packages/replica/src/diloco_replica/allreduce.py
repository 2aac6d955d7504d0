"""All-reduce through an object store: reduce-scatter then all-gather, each replica owning 1/N.

The store cannot add, so the replicas do the reduction (LambdaML's reduce-scatter through S3).
Round r, replica i with pseudo-gradient Δ_i split into N contiguous shards, shard j owned by j:

1. scatter: upload shard j of Δ_i to ``r/scatter/j/i`` for every j ≠ i, then a tiny
   ``r/ready/i`` marker (so "ready" implies all its shards are in the store);
2. membership (`membership.Membership`): one create-only ``members.json`` fixes who is in;
3. reduce: the reducer of shard j (j itself if it is a member, else the member at position
   j mod |members|) averages the members' contributions in rank order in fp32, encodes the mean
   with the transport codec and create-only puts ``r/reduced/j``. A contribution that fails its
   checksum twice, does not fit the round's layout (`wire.check_layout`) or holds NaN/Inf
   (`finite`) is left out of that shard's mean, and the reduced object says so — who was left
   out for non-finite values too, so every replica learns it and that sender resets itself. A
   mean that would not be finite is never published (`finite.NonFinite` stops the run);
4. gather: download the other N−1 reduced shards. One that does not appear within the timeout
   (its reducer died) is taken over by exactly one waiting replica — whoever wins the
   create-only ``r/claim/j.<g>`` — while the rest keep waiting for its result; a claimant that
   dies too is replaced by generation g+1.

Every replica decodes the same reduced bytes (the reducer too), so the mean is bit-identical
everywhere. A reduced shard that is corrupt in the store is re-published by its reducer
(`repairs.RepairDesk`). Every step reaches the store through one `roundio.RoundIO`.

Per replica and round, with its shard reduced by itself: up S (N−1 shards out, one reduced
shard), down 2(N−1)/N·S — the ring all-reduce bound; O(N) requests.

With the `topk` transport a replica sparsifies each shard of Δ + its error-feedback residual
(`codecs.sparsify`), keeps what it does not send in the residual, and contributes exactly what the
others decode; a reducer's mean is the union of its members' supports, encoded sparse as well.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from diloco.settings import DilocoSettings
from diloco.store import Store

from .codecs import sparsify
from .faults import Faults
from .finite import NONFINITE, Contribution, NonFinite, accumulate, all_finite
from .checkpoints import Checkpoints
from .lanes import Lanes
from .membership import Membership
from .rounderrors import FellBehind, RoundFailed
from .laps import Laps
from .repairs import RepairDesk
from .roundio import RoundIO
from .storeaccess import CountingStore, LaneShards, RunKeys, Traffic, reducer_of, shard_bounds
from .streaming import (DeltaSource, Prefetch, Published, ReadOnceThenRefetch, RoundSink, WholeDelta,
                        Window, buffer_sink, pool_width, window_for)
from .wire import Identity, decode_tensor, encode_tensor, pack

__all__ = ["FellBehind", "RoundFailed", "RoundResult", "StoreAllReduce"]


@dataclass
class RoundResult:
    round: int
    members: list[int]
    mean: torch.Tensor | None       # None when the round's means went to a sink, shard by shard
    member: bool                    # whether this replica's update is in the mean
    traffic: Traffic
    seconds: float
    takeovers: list[int] = field(default_factory=list)
    incidents: list[dict[str, Any]] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)  # upload / wait / reduce / download seconds
    nonfinite: list[int] = field(default_factory=list)  # ranks some shard's mean left out for NaN/Inf values


class StoreAllReduce:
    """One replica's (one lane's) side of the store all-reduce. `io` is the round's I/O object,
    shared with membership, checkpoints, repairs, the global state and the recorder."""

    def __init__(self, store: Store, run_id: str, rank: int, world_size: int, *, codec: str = "fp32",
                 round_timeout: float = 300.0, min_members: int = 1, poll_interval: float = 0.05,
                 poll_max: float = 1.0, workers: int | None = None, log: Callable[[str], None] | None = None,
                 lanes: Lanes | None = None, topk_density: float = DilocoSettings.topk_density,
                 step_cap: int | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of {world_size}")
        lanes = lanes or Lanes()
        self.io = RoundIO(store=CountingStore(store), keys=RunKeys(run_id),
                          shards=LaneShards(lanes.index, world_size, lanes.count), lanes=lanes,
                          pool=ThreadPoolExecutor(max_workers=max(2, min(workers or pool_width(world_size),
                                                                          2 * world_size))),
                          run_id=run_id, rank=rank, n=world_size, round_timeout=round_timeout,
                          poll_interval=poll_interval, poll_max=poll_max, log=log or (lambda msg: None),
                          faults=Faults(rank, lanes.index), codec=codec)
        self.rank, self.n, self.lanes = rank, world_size, lanes
        self.codec, self.topk_density = codec, topk_density
        # Time-based rounds (`round_seconds`): each contribution states its inner steps (1..step_cap)
        # and a shard's mean is FedNova's: mean_i(Δ_i / τ_i) · mean_i(τ_i) over the members in it.
        self.step_cap = step_cap
        self._own_steps: int | None = None  # this replica's τ in the round it is in
        self.window = window_for(world_size, self.io.pool._max_workers)  # shards in flight (`streaming`)
        self.checkpoints = Checkpoints(self.io)
        self.membership = Membership(self.io, self.checkpoints, min_members=min_members)
        self.repairs = RepairDesk(self.io, self.membership)
        self._cleanup_due: tuple[int, list[int], list[int]] | None = None
        self._finished: tuple[int, float] | None = None  # (round, when) this replica last completed one

    @property
    def store(self) -> CountingStore:
        return self.io.store

    def phase(self, name: str, r: int) -> None:
        """Where this replica is in round r, for the fault-injection harness."""
        self.io.faults.phase(name, r)

    def run_round(self, r: int, delta: torch.Tensor | DeltaSource, *, in_place: bool = False,
                  residual: torch.Tensor | None = None, sink: RoundSink | None = None,
                  steps: int | None = None) -> RoundResult:
        """Take part in round `r` with `delta` (fp32, CPU, flat; or a `DeltaSource` read a shard at
        a time); return the members' mean, or hand it to `sink` shard by shard (`streaming`).

        `in_place`: the mean is written over `delta` (shard j's slice of Δ is only read until
        shard j's mean is known), so a round holds one model-sized buffer, not two.
        `residual`: the topk transport's error feedback, as long as `delta`; added to Δ before
        sparsifying, and left holding what was not sent.
        `sink(j, a, b, mean_j)`: called once per shard as its mean is known (on pool threads, for
        distinct shards at once); no mean buffer is made and `RoundResult.mean` is None.
        `steps`: the inner steps behind `delta` (time-based rounds, `step_cap` set: required).
        """
        if self.step_cap is not None and not (isinstance(steps, int) and 1 <= steps <= self.step_cap):
            raise ValueError(f"time-based rounds need the inner steps behind Δ (1..{self.step_cap}), not {steps!r}")
        self._own_steps = steps if self.step_cap is not None else None
        io = self.io
        t0, before = time.monotonic(), io.store.traffic.snapshot()
        laps = Laps()
        source = delta if hasattr(delta, "shard") else WholeDelta(delta.detach().to("cpu", torch.float32).reshape(-1))
        bounds = shard_bounds(source.numel, self.n)
        mean = None
        if sink is None:
            mean = source.delta if in_place and isinstance(source, WholeDelta) else torch.empty(source.numel)
            sink = buffer_sink(mean)
        members = self.lanes.on_leader(lambda: self._decided_or_open(r))
        sent: dict[int, list[memoryview]] = {}  # topk: each shard as encoded (what everyone decodes)
        if members is None:
            self.phase("upload", r)
            if self.codec == "topk":
                sent = self._sparsify(source, bounds, residual)
            gate = Window(self.window)

            def put(j: int) -> None:
                with gate:  # at most `window` shards of Δ exist at once
                    a, b = bounds[j]
                    self._put_scatter(r, j, None if j in sent else source.shard(a, b), sent.get(j), b - a)

            def upload() -> None:
                for f in [io.pool.submit(put, j) for j in range(self.n) if j != self.rank]:
                    f.result()

            self.lanes.agree(upload)  # "ready" means every lane's shards are in the store
            laps.lap("upload")
            self.phase("membership", r)
            with self.repairs.waiting():  # every lane: a reader stuck on last round's shard holds this up
                members = self.lanes.on_leader(lambda: self._ready_and_decide(r))
        laps.lap("wait")
        # The previous round's reduced shards stay servable until this round is formed: a reader
        # that found one corrupt is still finishing that round, and this round waits for it.
        self.repairs.next_round()
        member = self.rank in members
        if not member:
            io.log(f"round {r}: not a member (members {members}); this replica's update is left out")

        def own(j: int) -> torch.Tensor:
            """This replica's contribution to shard j, as the others would decode it."""
            a, b = bounds[j]
            return decode_tensor(b"".join(sent[j]), "topk", b - a) if j in sent else source.shard(a, b)

        incidents: list[dict[str, Any]] = []
        nonfinite: set[int] = set()
        mine = [j for j in range(self.n) if reducer_of(j, members) == self.rank] if member else []
        if mine:
            self.phase("reduce", r)
        for j in mine:
            a, b = bounds[j]
            sink(j, a, b, self._reduce_shard(r, j, bounds[j], members, own, takeover=False, incidents=incidents,
                                             nonfinite=nonfinite))
        laps.lap("reduce")
        self.phase("gather", r)
        if mine:
            self.repairs.watch()  # a reader may find a shard published here corrupt while this replica gathers
        with self.repairs.waiting():
            takeovers = self._gather(r, bounds, members, sink, set(mine), own if member else None, incidents,
                                     nonfinite=nonfinite)
        self._run_cleanup()
        if mine:
            self._cleanup_due = (r, mine, members)  # inputs stay one round, for takeovers and repairs
            self.repairs.look_soon()
        laps.lap("download")
        self._finished = (r, time.monotonic())
        return RoundResult(r, members, mean, member, io.store.traffic.since(before), time.monotonic() - t0,
                           takeovers, incidents, {"upload": 0.0, **laps.seconds}, sorted(nonfinite))

    def _decided_or_open(self, r: int) -> list[int] | None:
        """Round r's members if already decided (we are late); None if it is open to join.

        Skipped (two requests a round: a GET of members.json, a LIST of the low-water mark) when
        this replica finished round r − 1 less than round_timeout/2 ago: the others decide a
        round without a replica only round_timeout after they were ready for it, and none was
        ready before finishing r − 1, so round r is still open and far from collected. A replica
        late after all learns it in `Membership.decide` (the round's record is there)."""
        last = self._finished
        if last is not None and last[0] == r - 1 and time.monotonic() - last[1] < self.io.round_timeout / 2:
            return None
        members = self.membership.read(r)
        if members is None:
            self.membership.check_not_collected(r)
        return members

    def _ready_and_decide(self, r: int) -> list[int]:
        """(Lane 0, once per replica) mark this replica ready, then fix the round's members."""
        self.io.put(self.io.keys.ready(r, self.rank), b"{}", create_only=True)
        return self.membership.decide(r)

    def fetch(self, r: int, numel: int, *, sink: RoundSink | None = None) -> RoundResult:
        """Read round `r`'s result without contributing (replay, catching up); to `sink` shard by
        shard if given, else into `RoundResult.mean`."""
        t0, before = time.monotonic(), self.io.store.traffic.snapshot()
        members = self.membership.read(r)
        if members is None:
            self.membership.check_not_collected(r)
            raise RoundFailed(f"round {r} has no membership record; it has not happened yet")
        mean = None
        if sink is None:
            mean = torch.empty(numel, dtype=torch.float32)
            sink = buffer_sink(mean)
        incidents: list[dict[str, Any]] = []
        takeovers = self._gather(r, shard_bounds(numel, self.n), members, sink, set(), None, incidents,
                                 replay=True)
        return RoundResult(r, members, mean, False, self.io.store.traffic.since(before), time.monotonic() - t0,
                           takeovers, incidents)

    def round_complete(self, r: int) -> bool:
        """Whether every reduced shard of this lane for round `r` is in the store (one LIST request)."""
        return len(self.io.present(self.io.keys.reduced(r))) >= self.n

    # -- steps -------------------------------------------------------------------------------

    def _sparsify(self, source: DeltaSource, bounds: list[tuple[int, int]],
                  residual: torch.Tensor | None) -> dict[int, list[memoryview]]:
        """topk: each shard of Δ (+ residual) → what is sent, encoded; the residual keeps the rest.

        The encoded shards are small (the density's share of Δ) and are what this replica
        contributes to every mean, its own shard's and a taken-over one's, as others decode it.
        """
        encoded = {}
        for j, (a, b) in enumerate(bounds):
            part = source.shard(a, b)
            if residual is not None:
                part += residual[a:b]
            parts = encode_tensor(sparsify(part, self.topk_density), "topk")
            if residual is not None:
                torch.sub(part, decode_tensor(b"".join(parts), "topk", b - a), out=residual[a:b])
            encoded[j] = parts
        return encoded

    def _put_scatter(self, r: int, owner: int, part: torch.Tensor | None, encoded: list[memoryview] | None,
                     numel: int) -> None:
        io, sid = self.io, self.io.sid(owner)
        ident = Identity(io.run_id, r, "scatter", sid, self.rank)
        encoded = encoded if encoded is not None else encode_tensor(part, self.codec)
        blob = pack(ident, encoded, codec=self.codec, numel=numel, meta=self._scatter_meta())
        io.put(io.keys.scatter(r, sid, self.rank), blob, written=("scatter", r, sid, self.rank))

    def _scatter_meta(self) -> dict[str, Any] | None:
        """What a contribution states besides its values: its inner steps, in time-based rounds."""
        return {"steps": self._own_steps} if self._own_steps is not None else None

    def _reduce_shard(self, r: int, j: int, bound: tuple[int, int], members: list[int],
                      own: Callable[[int], torch.Tensor] | None, *, takeover: bool, incidents: list[dict[str, Any]],
                      nonfinite: set[int] | None = None) -> torch.Tensor:
        """Average shard j over `members`, publish it (create-only), return the decoded mean.

        Contributions are folded into one shard-sized total in rank order as they arrive, at most
        `window` downloads held at once (`streaming.Prefetch`); `own(j)` is this replica's part.
        A contribution missing, unreadable, not of the round's layout or non-finite is left out
        (an incident each). The published object names who was left out and why; `nonfinite`
        collects who was left out for NaN/Inf, so that sender learns it and resets.
        """
        io = self.io
        a, b = bound
        sources = [m for m in members if m != self.rank or own is None]
        if takeover and j in sources and j != self.rank:
            sources.remove(j)  # a dead owner kept its own part of shard j locally: it is gone

        def fetch(m: int):
            return io.get_verified(io.keys.scatter(r, io.sid(j), m), Identity(io.run_id, r, "scatter", io.sid(j), m),
                                   numel=b - a, codec=self.codec)

        prefetch = Prefetch(io.pool, fetch, sources, self.window)
        left_out: dict[str, str] = {}
        steps_of: dict[int, int] = {}  # time-based rounds: each contribution's inner steps

        def contributions():
            for m in members:
                key = io.keys.scatter(r, io.sid(j), m)  # for this replica's own part: the object it would be
                if m == self.rank and own is not None:
                    if self._own_steps is not None:
                        steps_of[m] = self._own_steps
                    yield Contribution(m, key, lambda: own(j), 1.0 / steps_of.get(m, 1))
                elif m in sources:
                    obj, problem = prefetch.next(m)
                    if obj is None:
                        if problem == "missing":
                            self.membership.check_not_collected(r)
                        published = self.repairs.published_or_none(r, j, b - a, nonfinite)
                        if published is not None:  # reduced (and inputs cleaned) while we looked: use that
                            raise Published(published)
                        left_out[str(m)] = self._left_out(r, j, key, m, problem, incidents)
                        continue
                    if self.step_cap is not None:
                        steps = obj.meta.get("steps")
                        if type(steps) is not int or not 1 <= steps <= self.step_cap:
                            left_out[str(m)] = self._left_out(r, j, key, m, f"its inner-step count {steps!r} is not "
                                                              f"an integer in 1..{self.step_cap}", incidents)
                            continue
                        steps_of[m] = steps
                    reader = ReadOnceThenRefetch(obj, lambda m=m: fetch(m))
                    del obj  # this frame must not keep the download alive while the next one comes
                    yield Contribution(m, key, reader.read, 1.0 / steps_of.get(m, 1))

        try:
            summed = accumulate(contributions(), b - a)
        except Published as done:
            return done.values
        finally:
            prefetch.cancel()
        for m, problem in summed.corrupt.items():
            left_out[str(m)] = self._left_out(r, j, io.keys.scatter(r, io.sid(j), m), m, problem, incidents)
        for m in summed.nonfinite:
            left_out[str(m)] = self._left_out(r, j, io.keys.scatter(r, io.sid(j), m), m, f"{NONFINITE} in its update",
                                              incidents, nonfinite=True)
        if not summed.used:
            if summed.nonfinite and len(summed.nonfinite) == len(left_out):
                raise NonFinite(f"round {r}: every contribution to shard {j} is non-finite (NaN or Inf), from ranks "
                                f"{summed.nonfinite}: training diverged on every member, so no finite global state "
                                f"can follow; lower the learning rate (or check the data) and start a new run")
            raise RoundFailed(f"round {r}: no usable contribution to shard {j}")
        mean = summed.total.div_(len(summed.used))  # in place: one shard-sized buffer (same rounding as total / n)
        meta = {"members": summed.used, "left_out": left_out, "nonfinite": summed.nonfinite, "reducer": self.rank,
                "takeover": takeover}
        if self.step_cap is not None:  # FedNova: the mean of Δ_i/τ_i, scaled back by the mean τ
            used_steps = [steps_of[m] for m in summed.used]
            mean.mul_(sum(used_steps) / len(used_steps))
            meta["steps"] = dict(zip(map(str, summed.used), used_steps))
        ident = Identity(io.run_id, r, "reduced", io.sid(j), -1)
        blob = pack(ident, encode_tensor(mean, self.codec), codec=self.codec, numel=b - a, meta=meta)
        payload = blob[1] if len(blob) == 2 else b"".join(blob[1:])
        decoded = decode_tensor(payload, self.codec, b - a)  # exactly what every reader decodes
        # fp32 decodes to total / k exactly, finite with the total; another codec's range may overflow
        if not (summed.finite and self.codec == "fp32" and self.step_cap is None) and not all_finite(decoded):
            raise NonFinite(f"round {r}: the mean of shard {j} would be non-finite in transport {self.codec!r} "
                            f"(it overflowed): training diverged; it is not published. Lower the learning rate and "
                            f"start a new run")
        if io.put(io.keys.reduced(r, io.sid(j)), blob, create_only=True, written=("reduced", r, io.sid(j))):
            self.repairs.publish(r, j, blob)
            if nonfinite is not None:
                nonfinite.update(summed.nonfinite)
            return decoded
        return self.repairs.read_reduced(r, j, b - a, members, incidents, nonfinite)  # someone else won: use theirs

    def _left_out(self, r: int, j: int, key: str, m: int, problem: str, incidents: list[dict[str, Any]], *,
                  nonfinite: bool = False) -> str:
        """Record that rank m's part of shard j is not in its mean (an incident); returns why."""
        incident = {"round": r, "object": key, "writer": m, "problem": problem,
                    "action": f"left out of shard {j}'s mean by rank {self.rank}"}
        if nonfinite:
            incident.update(replica=m, action=f"{incident['action']}; rank {m} resets to θ_global")
        incidents.append(incident)
        self.io.log(f"round {r}: {key} from rank {m}: {problem}; left out of shard {j}'s mean")
        return problem

    def _gather(self, r: int, bounds: list[tuple[int, int]], members: list[int], sink: RoundSink,
                have: set[int], own: Callable[[int], torch.Tensor] | None, incidents: list[dict[str, Any]], *,
                replay: bool = False, nonfinite: set[int] | None = None) -> list[int]:
        """Hand `sink` every reduced shard not in `have`; one replica takes over any that never appears.

        `replay`: the round is known complete, so a shard missing now was garbage-collected under
        us: rejoin at once (FellBehind) instead of waiting out the timeout.

        Each shard is fetched, verified, decoded and handed to `sink` on a pool thread, at most
        `window` at once, so checksums and the outer step overlap with waiting for the others
        and no more than `window` reduced shards are held.
        """
        io = self.io
        prefix = io.keys.reduced(r)
        wanted = [j for j in range(self.n) if j not in have]
        taken_over: list[int] = []
        generation = {j: 0 for j in wanted}
        gate = Window(self.window)

        def fetch(j: int) -> None:
            a, b = bounds[j]
            with gate:
                sink(j, a, b, self.repairs.read_reduced(r, j, b - a, members, incidents, nonfinite))

        pending = []
        while wanted:
            deadline = time.monotonic() + io.round_timeout
            backoff = io.backoff()
            waited = False
            while wanted:
                with io.store.polling(waited):  # re-listing after a wait is a poll
                    present = io.present(prefix)
                pending += [io.pool.submit(fetch, j) for j in wanted if j in present]
                wanted = [j for j in wanted if j not in present]
                if wanted and replay:
                    self.membership.check_not_collected(r)
                if wanted and not backoff.sleep(deadline):
                    break
                waited = True
            for j in list(wanted):  # its reducer (or the last claimant) never published
                if not io.put(io.keys.claim(r, io.sid(j), generation[j]), str(self.rank).encode(), create_only=True):
                    generation[j] += 1  # someone else claimed it: wait for their result, then claim the next
                    continue
                io.log(f"round {r}: reduced shard {j} did not appear in {io.round_timeout:g}s; reducing it here")
                a, b = bounds[j]
                sink(j, a, b, self._reduce_shard(r, j, bounds[j], members, own, takeover=True, incidents=incidents,
                                                 nonfinite=nonfinite))
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
        io = self.io
        keys = [io.keys.scatter(r, io.sid(j), m) for j in owned for m in members if m != self.rank]

        def delete_all() -> None:
            try:
                io.store.delete_many(keys)  # one request per 1,000 keys on S3
            except Exception:  # best effort; a leftover object costs storage, not correctness
                pass

        io.pool.submit(delete_all)

    def close(self) -> None:
        self.repairs.close()
        self.io.pool.shutdown(wait=True)

    def describe(self) -> dict[str, Any]:
        return {"run": self.io.run_id, "rank": self.rank, "world_size": self.n, "codec": self.codec,
                "topk_density": self.topk_density,
                "lane": self.lanes.index, "lanes": self.lanes.count}
