"""All-reduce through an object store: reduce-scatter then all-gather, each replica owning 1/N.

The store cannot add, so the replicas do the reduction (LambdaML's reduce-scatter through S3).
Round r, replica i with pseudo-gradient Δ_i split into N contiguous shards, shard j owned by j:

1. scatter (`upload.Uploader`): upload shard j of Δ_i to ``r/scatter/j/i.<lane>`` for every
   j ≠ i, then a tiny ``r/ready/i.<lanes>.<incarnation>`` marker (so "ready" implies all its
   shards are in the store);
2. membership (`membership.Membership`): one create-only ``members.json`` fixes who is in;
3. reduce (`reduce.ShardReducer`): the reducer of shard j (j itself if it is a member, else the
   member at position j mod |members|) averages the members' contributions in rank order in
   fp32, encodes the mean with the transport codec and create-only puts ``r/reduced/j``; a
   contribution it cannot use is left out, and the reduced object says so;
4. gather (`gather.Gatherer`): download the other N−1 reduced shards as the gatherer finds them
   published. One that does not appear within the timeout (its reducer died) is taken over by
   exactly one waiting replica, whose gatherer reduces it with the replica's own `ShardReducer`.
   The calls go one way: this module calls the uploader, the reducer and the gatherer, and the
   gatherer the reducer; none calls back, and they return what they did (a `reduce.Reduction`,
   the gatherer's `Arrival`s) rather than read or keep reduced shards themselves.

A shard over `part_mb` MiB of fp32 is cut into P parts, each an object of its own and a shard
of the round in every step above: N·P shards, replica i owning i·P … i·P + P − 1
(`roundstate.Round.owner`; a dead owner's parts are spread over the members). With P > 1 a
replica's own parts are reduced on two threads beside its gather, so folding part k, uploading
its mean and downloading the peers' finished parts overlap instead of running one after another.

Shards are cut from the model's whole flat vector, never per process (`layout`): a replica of
L processes sends each shard as the pieces its lanes hold (``scatter/j/i.<k>``), its lane
holding the shard's first value keeps its own piece when the shard is the replica's to reduce,
and the reducer assembles every member's pieces by the lane counts in the membership record. So
replicas of 1, 2 and 8 processes meet in one round.

Every replica decodes the same reduced bytes (the reducer too), so the mean is bit-identical
everywhere. A reduced shard that is corrupt in the store is re-published by its reducer
(`repairs.RepairDesk`, reached from this module only: it reads every reduced shard, keeps what
this replica published and serves repairs between the steps). Every step reaches the store
through one `roundio.RoundIO`, and every step of a round reads and adds to one
`roundstate.Round`; this module runs the steps in order.

Per replica and round, with its shard reduced by itself: up S (N−1 shards out, one reduced
shard), down 2(N−1)/N·S — the ring all-reduce bound; O(N·P) requests.

With the `topk` transport a replica contributes the sparse pieces it sends (`upload`), and a
reducer's mean is the union of its members' supports, encoded sparse as well.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from diloco.store.runkeys import RunKeys
from diloco.spec.settings import DilocoSettings
from diloco.store.objectstore import Store
from diloco.store.wiresize import parts_per_shard

from .checkpoints import Checkpoints
from ..transport.faults import Faults
from .steps.gather import Gatherer
from .lanes import Lanes
from .laps import Laps
from ..transport.codecdevice import CodecDevice
from .layout import Cut
from .steps.membership import Decided, Membership
from .steps.reduce import Reduction, ShardReducer
from .steps.repairs import RepairDesk
from .errors import FellBehind, RoundFailed
from .io import RoundIO
from .state import Round, RoundResult
from .storeaccess import CountingStore
from .streaming import DeltaSource, RoundSink, WholeDelta, Window, buffer_sink, pool_width, window_for
from .steps.upload import Uploader

__all__ = ["FellBehind", "RoundFailed", "RoundResult", "StoreAllReduce"]


class StoreAllReduce:
    """One replica's (one lane's) side of the store all-reduce. `io` is the round's I/O object,
    shared with membership, checkpoints, repairs, the global state and the recorder."""

    def __init__(self, store: Store, run_id: str, rank: int, world_size: int, *, codec: str = "fp32",
                 round_timeout: float = 300.0, min_members: int = 1, poll_interval: float = 0.05,
                 poll_max: float = 1.0, workers: int | None = None, log: Callable[[str], None] | None = None,
                 lanes: Lanes | None = None, topk_density: float = DilocoSettings.topk_density,
                 step_cap: int | None = None, part_mb: float = DilocoSettings.part_mb,
                 round_grace: float | None = None, incarnation: int = 0, codec_device: CodecDevice | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of {world_size}")
        lanes = lanes or Lanes()
        pool_size = max(2, workers or pool_width(world_size))
        self.io = RoundIO(store=CountingStore(store), keys=RunKeys(run_id), lanes=lanes,
                          pool=ThreadPoolExecutor(max_workers=pool_size),
                          run_id=run_id, rank=rank, n=world_size, round_timeout=round_timeout,
                          poll_interval=poll_interval, poll_max=poll_max, log=log or (lambda msg: None),
                          faults=Faults(rank, lanes.index), codec=codec)
        self.rank, self.n, self.lanes, self.incarnation = rank, world_size, lanes, incarnation
        self.codec, self.topk_density, self.part_mb = codec, topk_density, part_mb
        # Time-based rounds (`round_seconds`): each contribution states its inner steps (1..step_cap)
        # and a shard's mean is FedNova's (`reduce`).
        self.step_cap = step_cap
        self.window = window_for(world_size, pool_size)  # whole shards in flight (`streaming`)
        # With parts, the gather and a replica's own reductions run on threads of their own, beside
        # each other (the gather and two reductions: one folds while the other downloads), never
        # on the pool their downloads queue on.
        self.beside = ThreadPoolExecutor(max_workers=3, thread_name_prefix="diloco-round")
        self.checkpoints = Checkpoints(self.io)
        self.membership = Membership(self.io, self.checkpoints, min_members=min_members, round_grace=round_grace)
        self.repairs = RepairDesk(self.io, self.membership, incarnation=incarnation)
        self.reducer = ShardReducer(self.io, self.membership, window=self.window, step_cap=step_cap,
                                    codec_device=codec_device)
        self.gatherer = Gatherer(self.io, self.membership, self.reducer)
        self.uploader = Uploader(self.io, codec=codec, topk_density=topk_density, window=self.window,
                                 codec_device=codec_device)
        self._cleanup_due: list[str] | None = None  # the inputs of the last round this lane reduced
        self.rosters: dict[int, list[int]] = {}  # round -> its ranks, as decided with the round before (`roster`)
        self._finished: tuple[int, float] | None = None  # (round, when) this replica last completed one

    @property
    def store(self) -> CountingStore:
        return self.io.store

    def phase(self, name: str, r: int) -> None:
        """Where this replica is in round r, for the fault-injection harness."""
        self.io.faults.phase(name, r)

    def roster(self, r: int) -> list[int]:
        """Round r's ranks, in order: as round r − 1's membership record decided them (learnt when
        this replica finished or replayed it, or from the checkpoint it loaded); round 1's, if
        nothing says otherwise, are the launch's 0 … N−1."""
        if r not in self.rosters and r > 1:
            decided = self.membership.read(r - 1)
            if decided is not None:
                self.rosters[r] = decided.next
        return self.rosters.get(r) or list(range(self.n))

    def cut(self, total: int, start: int, stop: int, r: int) -> Cut:
        """How round r, syncing [start, stop) of a model of `total` values, is cut (`layout.Cut`):
        N·P shards (N from its roster, P from the fragment's size), the same for every replica
        whatever its lanes."""
        n = len(self.roster(r))
        return Cut(total, start, stop, n, parts_per_shard(stop - start, n, self.part_mb))

    def _round(self, r: int, cut: Cut, **kw: Any) -> Round:
        return Round(r, cut, self.rank, self.lanes.index, self.lanes.count, codec=self.codec,
                     roster=self.roster(r), **kw)

    def _learn(self, r: int, decided: Decided) -> None:
        """Round r's record: the next round's roster."""
        self.rosters[r + 1] = decided.next

    def run_round(self, r: int, delta: torch.Tensor | DeltaSource, *, cut: Cut | None = None, in_place: bool = False,
                  residual: torch.Tensor | None = None, sink: RoundSink | None = None,
                  steps: int | None = None, encoded: dict[int, list[memoryview]] | None = None,
                  laps: Laps | None = None) -> RoundResult:
        """Take part in round `r`, cut as `cut`, with `delta` (fp32, CPU, flat: this lane's Δ over
        what it holds of the round's vector, `cut.held`; or a `DeltaSource` read a slice at a
        time); return the members' mean over the same slice, or hand it to `sink` shard by shard
        (`streaming`), in the lane's own coordinates. No `cut`: `delta` is a whole model synced by
        one lane.

        `in_place`: the mean is written over `delta` (a slice of Δ is only read until its
        shard's mean is known), so a round holds one model-sized buffer, not two.
        `residual`: the topk transport's error feedback, as long as `delta`; added to Δ before
        sparsifying, and left holding what was not sent.
        `sink(j, a, b, mean)`: called once per shard with this lane's piece of its mean (on pool
        threads, for distinct shards at once); no mean buffer is made and `RoundResult.mean` is None.
        `steps`: the inner steps behind `delta` (time-based rounds, `step_cap` set: required).
        `encoded`: pieces already encoded in the run's codec from exactly these values (error
        feedback's quantising, `feedback`), uploaded as they are instead of encoded again; with a
        `WholeDelta` (which holds the same values) the dict is emptied once they are up, so the
        bytes are not held through the round; with a source read per piece they are the only
        copy of what was sent, kept for the folds that read this lane's pieces.
        `laps`: the round's clock, if the caller started it earlier (what it did before this call
        is the upload's preparation); the phases are read from `RoundResult.phases`.
        """
        if self.step_cap is not None and not (isinstance(steps, int) and 1 <= steps <= self.step_cap):
            raise ValueError(f"time-based rounds need the inner steps behind Δ (1..{self.step_cap}), not {steps!r}")
        io = self.io
        started, before = time.monotonic(), io.store.traffic.snapshot()
        laps = laps if laps is not None else Laps()  # Δ's copy to the host counts
        source = delta if hasattr(delta, "shard") else WholeDelta(delta.detach().to("cpu", torch.float32).reshape(-1))
        if cut is None:
            if self.lanes.count != 1:
                raise ValueError("a replica of several lanes states how its round is cut (`cut`)")
            cut = self.cut(source.numel, 0, source.numel, r)
        rnd = self._round(r, cut, source=source, sent=encoded if encoded is not None else {},
                          steps=steps if self.step_cap is not None else None, laps=laps, traffic_before=before,
                          started=started)
        held = rnd.held[1] - rnd.held[0]
        if source.numel != held:
            raise ValueError(f"Δ has {source.numel} values; lane {rnd.lane} of {rnd.lanes} holds {held} of this round")
        mean = None
        if sink is None:
            mean = source.delta if in_place and isinstance(source, WholeDelta) else torch.empty(held)
            sink = buffer_sink(mean)
        decided = self.lanes.on_leader(lambda: self._decided_or_open(r))
        if decided is None:
            self.phase("upload", r)
            self.uploader.upload(rnd, residual)
            rnd.laps.lap("upload")
            self.phase("membership", r)
            with self.repairs.waiting():  # every lane: a reader stuck on last round's shard holds this up
                decided = self.lanes.on_leader(lambda: self._ready_and_decide(r))
        rnd.laps.lap("wait")
        members = Decided.from_json(decided)
        rnd.members, rnd.layouts, rnd.incarnations = members.members, members.layouts, members.incarnations_of
        self._learn(r, members)
        # The previous round's reduced shards stay servable until this round is formed: a reader
        # that found one corrupt is still finishing that round, and this round waits for it.
        self.repairs.next_round()
        if not rnd.member:
            io.log(f"round {r}: not a member (members {rnd.members}); this replica's update is left out")
        mine = [j for j in cut.live if rnd.reduces(j)]
        if mine:
            self.phase("reduce", r)
        self._reduce_and_gather(rnd, mine, sink)
        self._run_cleanup()
        if mine:
            self._cleanup_due = self._inputs(rnd, mine)  # inputs stay one round, for takeovers and repairs
            self.repairs.look_soon()
        rnd.laps.lap("download")
        self._finished = (r, io.clock())
        return rnd.result(mean, io.store.traffic)

    def _reduce_and_gather(self, rnd: Round, mine: list[int], sink: RoundSink) -> None:
        """Reduce the shards in `mine` and bring every other mean to `sink`.

        Each own mean goes to the sink on a pool thread, so its outer step overlaps the downloads
        instead of delaying them (it costs no memory: `repairs` keeps the published mean through
        the gather anyway). With parts (P > 1) the gather runs beside the reducing, so a peer's
        published parts download and apply while this replica still folds its own; a reduction
        that fails stops the gather at its next look rather than after the round timeout.
        """
        io, r = self.io, rnd.r
        applying: list[Future] = []

        def reduce_own(j: int) -> None:
            if rnd.stop.is_set():  # an earlier part failed: the round fails, the rest is not worth reducing
                return
            mean = self._settle(rnd, self.reducer.reduce(rnd, j, takeover=False))
            applying.append(io.pool.submit(rnd.deliver, sink, j, mean))

        def gather() -> None:
            with self.repairs.waiting():
                self._gather(rnd, sink, set(mine))

        reducing: list[Future] = []
        try:
            if rnd.cut.parts == 1:  # whole shards: nothing of the others' is published before this one's own
                for j in mine:
                    reduce_own(j)
                rnd.laps.lap("reduce")
                self.phase("gather", r)
                gather()
            else:
                gathering = self.beside.submit(gather)
                reducing = [self.beside.submit(reduce_own, j) for j in mine]
                for f in reducing:
                    f.add_done_callback(lambda f: f.exception() is not None and rnd.stop.set())
                wait(reducing)
                rnd.laps.lap("reduce")
                self.phase("gather", r)
                gathering.result()
        finally:  # never return (or fail) while a reduction or a sink still writes into the caller's buffers
            wait(reducing)
            errors = [f.exception() for f in reducing] + [f.exception() for f in applying]
        for error in errors:
            if error is not None:
                raise error

    def _settle(self, rnd: Round, reduction: Reduction) -> torch.Tensor:
        """The mean of a shard this replica reduced: kept for repairs if it published it, else read
        from the store."""
        if reduction.published_here:
            self.repairs.publish(rnd.r, reduction.j, reduction.blob)
            return reduction.mean
        return self.repairs.read_reduced(rnd, reduction.j)

    def _gather(self, rnd: Round, sink: RoundSink, have: set[int]) -> None:
        """Hand `sink` every reduced shard of `rnd` not in `have`, as the gatherer finds them: each
        read, verified and delivered on a pool thread, at most `window` shards' worth of parts at
        once, so checksums and the outer step overlap with waiting for the others."""
        gate, pending = Window(self.window * rnd.cut.parts), []

        def read_to_sink(j: int) -> None:
            try:
                rnd.deliver(sink, j, self.repairs.read_reduced(rnd, j))
            finally:
                gate.release()

        try:
            for arrival in self.gatherer.arrivals(rnd, have):
                if arrival.taken_over is not None:
                    rnd.deliver(sink, arrival.j, self._settle(rnd, arrival.taken_over))
                    continue
                gate.acquire()  # here, not in the task: no pool thread ever waits for the gate, so the
                pending.append(self.io.pool.submit(read_to_sink, arrival.j))  # own reductions never queue behind one
        finally:  # no sink task outlives the round: a rejoin next loads θ and the momentum in place
            wait(pending)
        for f in pending:
            f.result()

    def _decided_or_open(self, r: int) -> list | None:
        """Round r's members if already decided (we are late); None if it is open to join."""
        decided = self.membership.decided_or_open(r, self._finished)
        return decided.to_json() if decided is not None else None

    def _ready_and_decide(self, r: int) -> list:
        """(Lane 0, once per replica) mark this replica ready, then fix the round's members."""
        self.io.put(self.io.keys.ready(r, self.rank, self.lanes.count, self.incarnation), b"{}", create_only=True)
        return self.membership.decide(r, self.roster(r), self.roster(r - 1) if r > 1 else None).to_json()

    def fetch(self, r: int, cut: Cut, *, sink: RoundSink | None = None) -> RoundResult:
        """Read round `r`'s result without contributing (replay, catching up): what this lane
        holds of it, to `sink` shard by shard if given, else into `RoundResult.mean`."""
        rnd = self._round(r, cut, replay=True, traffic_before=self.io.store.traffic.snapshot())
        decided = self.membership.read(r)
        if decided is None:
            self.membership.check_not_collected(r)
            raise RoundFailed(f"round {r} has no membership record; it has not happened yet")
        rnd.members, rnd.layouts, rnd.incarnations = decided.members, decided.layouts, decided.incarnations_of
        self._learn(r, decided)
        mean = None
        if sink is None:
            mean = torch.empty(rnd.held[1] - rnd.held[0], dtype=torch.float32)
            sink = buffer_sink(mean)
        self._gather(rnd, sink, set())
        return rnd.result(mean, self.io.store.traffic)

    def round_complete(self, r: int, cut: Cut) -> bool:
        """Whether every reduced shard of round `r` is in the store (one LIST request)."""
        return set(cut.live) <= self.io.present(self.io.keys.reduced(r))

    def upload_layout(self, r: int, cut: Cut) -> tuple[dict[int, tuple[int, int]], set[int]]:
        """This lane's pieces of round r, cut as `cut` (shard -> [a, b) in the lane's own
        coordinates) and which of them it uploads (those it does not keep): error feedback
        quantises Δ the same way."""
        rnd = self._round(r, cut)
        h = rnd.held[0]
        pieces = {j: (rnd.piece(j)[0] - h, rnd.piece(j)[1] - h) for j in rnd.mine()}
        return pieces, {j for j in pieces if not rnd.keeps(j)}

    # -- after the round ---------------------------------------------------------------------

    def _inputs(self, rnd: Round, shards: list[int]) -> list[str]:
        """The pieces sent to the shards this lane reduced (every member's, but its own kept one)."""
        return [self.io.keys.scatter(rnd.r, j, m, k) for j in shards for m in rnd.members
                for k, _, _ in rnd.cut.pieces(j, rnd.layouts[m]) if (m, k) != (self.rank, rnd.lane)]

    def _run_cleanup(self) -> None:
        """Delete the scatter inputs of the previous round this lane reduced (dead weight now)."""
        keys, self._cleanup_due = self._cleanup_due, None
        if not keys:
            return
        io = self.io

        def delete_all() -> None:
            try:
                io.store.delete_many(keys)  # one request per 1,000 keys on S3
            except Exception:  # best effort; a leftover object costs storage, not correctness
                pass

        io.pool.submit(delete_all)

    def close(self) -> None:
        self.repairs.close()
        self.beside.shutdown(wait=True)
        self.io.pool.shutdown(wait=True)

    def describe(self) -> dict[str, Any]:
        return {"run": self.io.run_id, "rank": self.rank, "world_size": self.n, "codec": self.codec,
                "topk_density": self.topk_density,
                "lane": self.lanes.index, "lanes": self.lanes.count}
