"""θ_global and the outer optimizer's state: how a replica gets them, keeps them, and repairs them.

Every replica holds a CPU fp32 master copy of θ_global and the outer momentum and applies the
outer step itself (`outer.outer_step`, bit-reproducible), on bit-identical decoded inputs, so all
replicas stay identical without ever sending θ. A replica that starts, restarts, falls behind
the retained history, or learns that its state diverged from the others' loads the newest
usable checkpoint and replays the rounds after it (`checkpoints.Checkpoints`).

Nothing non-finite becomes or leaves the global state: θ_0 from the model, checkpoints loaded
(`checkpoints.Checkpoints.load`) and θ after every outer step are checked, and a θ that would be NaN or
Inf stops the run with one line (`finite.NonFinite`) before any checkpoint of it is written.
Incidents met while loading or replaying (a corrupt checkpoint or reduced shard) are reported
through `RoundIO.report`, to travel with the replica's next metrics row.

This lane holds θ_global and the momentum of its slice of the model (`layout.lane_range`), so
a lane's state, its rounds and its checkpoint pieces are all placed on the model's one flat
vector, whatever this replica's lane count.

With `fragments = K` the model is K contiguous fragments and round r updates fragment
(r − 1) mod K only (Streaming DiLoCo's staggered schedule): each fragment keeps its own slice of
θ_global and of the momentum, so a fragment's outer step sees exactly its own rounds. A lane
takes part in a round with what it holds of the fragment.
Checkpoints hold the whole state after a round, whichever fragment it updated.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..round.allreduce import StoreAllReduce
from ..transport.finite import NonFinite, all_finite
from ..round.lanes import Retry
from ..round.errors import FellBehind, RoundFailed
from ..round.layout import Cut, clip, cover, lane_fragment, lane_range, shard_bounds
from .step import outer_step, state_digest
from ..round.storeaccess import reducer_of


class GlobalState:
    def __init__(self, allreduce: StoreAllReduce, total: int, *, lr: float, momentum: float, nesterov: bool,
                 checkpoint_every: int = 10, log: Callable[[str], None] | None = None, fragments: int = 1,
                 theta_out: torch.Tensor | None = None):
        self.ar = allreduce
        self.io = allreduce.io  # the round's store, keys, pool and timeouts
        self.checkpoints = allreduce.checkpoints
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov
        self.checkpoint_every = checkpoint_every
        self.log = log or (lambda msg: None)
        self.round = 0
        self.theta: torch.Tensor | None = None
        self.buf: torch.Tensor | None = None
        self.written: dict[int, list[int]] = {}  # checkpoint round -> shards this replica wrote
        self.finished: tuple[int, list[int]] | None = None  # the last round this lane applied, and its members
        self.total = total  # values in the model
        lanes = self.io.lanes
        self.start, self.stop = lane_range(total, lanes.count, lanes.index)  # this lane's slice of it
        self.numel = self.stop - self.start
        self.checkpoints.total = total
        # θ_global lives here when given: a buffer the training process maps too (`sharedbuf`), so
        # a load copies into it and it never moves
        self.theta_out = theta_out
        self.fragments = fragments
        self.fragment_bounds = shard_bounds(total, fragments)  # of the model

    # -- fragments ---------------------------------------------------------------------------

    def fragment(self, r: int) -> int:
        """The fragment round r updates."""
        return (r - 1) % self.fragments

    def bounds(self, r: int) -> tuple[int, int]:
        """What this lane holds of round r's fragment, in the lane's own coordinates (maybe empty)."""
        lanes = self.io.lanes
        return lane_fragment(self.total, lanes.count, lanes.index, self.fragment(r), self.fragments)

    def cut(self, r: int) -> Cut:
        """How round r is cut (`StoreAllReduce.cut`): its fragment of the model, in N·P shards."""
        return self.ar.cut(self.total, *self.fragment_bounds[self.fragment(r)], r)

    # -- start -------------------------------------------------------------------------------

    def bootstrap(self, initial: Callable[[], torch.Tensor] | None, *, below: int | None = None) -> int:
        """Adopt the run's global state (creating round 0 from `initial()` if the run is new).

        `below`: only checkpoints older than this round are trusted (after a divergence).
        `initial` reads θ_0 from the model, only if round 0 must be written (so joining a running
        run never holds a copy of the model it is about to replace); None once this replica has
        joined: round 0 then exists or was collected.
        With several lanes, lane 0 picks the checkpoint, every lane loads its part of it, and
        they replay to the same round (`catch_up`); a lane that sees the store change under it
        sends the whole replica round the loop again.
        """
        lanes = self.io.lanes
        for _ in range(8):  # a checkpoint can vanish under GC between listing and loading
            try:
                chosen = lanes.on_leader(lambda: self._newest_usable(below))
                if chosen is None:
                    lanes.agree(lambda: self._write_initial(initial))
                    chosen = 0
                lanes.agree(lambda: self._load(chosen))
                replayed = self.catch_up(during="rejoin")
            except (Retry, FellBehind) as exc:  # GC overtook the load or the replay: start again from newer
                self.log(f"{exc}; reloading")
                continue
            self.log(f"joined at round {self.round} (checkpoint {chosen}, replayed {replayed} rounds)")
            return self.round
        raise RoundFailed("could not load a checkpoint: they kept changing under this replica")

    def _newest_usable(self, below: int | None) -> int | None:
        usable = [c for c in self.checkpoints.complete() if below is None or c < below]
        if usable:
            return usable[-1]
        if self.checkpoints.low_water() > 0:
            raise RoundFailed("no usable checkpoint is left in the store and the early rounds are gone")
        return None

    def _load(self, c: int) -> None:
        """Checkpoint c straight into θ_global's buffer (`theta_out`, the one the training loop
        reads) and the momentum's: a join holds no second copy of the state. A load that fails
        part-way is retried, from another checkpoint if need be, and overwrites them whole."""
        loaded = self.checkpoints.load(c, self.start, self.stop, into=(self.theta_out, self.buf))
        if loaded is None:
            raise Retry(f"checkpoint {c} changed while loading")
        self.theta, self.buf, self.ar.rosters[c + 1] = loaded
        self.round = c
        self.finished = None  # round c is a checkpoint already

    def catch_up(self, *, during: str = "catch-up") -> int:
        """Apply every round completed after ours; returns how many were applied.

        Each lane applies what it sees complete, then every lane replays to the furthest of them
        (a round one lane saw complete is decided, so its other lanes' shards come, or are taken
        over), so a replica's lanes always hold the same round.
        """
        lanes = self.io.lanes
        start = self.round

        def apply_next() -> None:
            r = self.round + 1
            self.begin(r)
            res = self.ar.fetch(r, self.cut(r), sink=self.sink(r))  # the outer step shard by shard, as each arrives
            for incident in res.incidents:  # e.g. a corrupt reduced shard, re-published by its reducer
                self.io.report({**incident, "during": during})
            self.finish(r, res.members)

        def replay_complete() -> None:
            while True:
                if not self.ar.round_complete(self.round + 1, self.cut(self.round + 1)):
                    return
                apply_next()

        def replay_to(target: int) -> None:
            while self.round < target:
                apply_next()

        lanes.agree(replay_complete)
        if lanes.count > 1:
            target = lanes.largest(self.round)
            lanes.agree(lambda: replay_to(target))
        return self.round - start

    def _write_initial(self, read_initial: Callable[[], torch.Tensor] | None) -> None:
        """Round 0: shard i of the model from replica i (each lane its piece of it); after a
        wait, any piece of this lane's slice still missing from here too.

        Create-only puts, so each piece has one writer and everyone loads the same θ_0
        (replicas should seed their model init identically; if they did not, θ_0 is still one
        consistent state that all of them adopt). Only the pieces still missing are written.
        """
        if read_initial is None:
            raise RoundFailed("round 0's checkpoint is missing although this replica joined the run before")
        initial = read_initial()
        if not all_finite(initial):
            raise NonFinite("the model's initial parameters hold NaN or Inf; fix the model's initialisation")
        shards = [clip(a, b, self.start, self.stop) for a, b in shard_bounds(self.total, self.io.n)]
        launch = list(range(self.io.n))  # round 1's roster: the launch's replicas

        def missing(j: int, present: list[tuple[int, int]]) -> bool:
            a, b = shards[j]
            return a < b and cover(present, a, b) is None

        if missing(self.io.rank, self.checkpoints.present(0)):
            self.checkpoints.put_piece(0, shards[self.io.rank], self.start, initial, None, launch)
        for _ in self.io.poll("round 0's checkpoint pieces"):
            present = self.checkpoints.present(0)
            if cover(present, self.start, self.stop) is not None:
                break
        for j in range(self.io.n):
            if missing(j, present):  # its owner never came: write it from here (create-only)
                self.checkpoints.put_piece(0, shards[j], self.start, initial, None, launch)

    # -- each round --------------------------------------------------------------------------

    def apply(self, r: int, mean_delta: torch.Tensor, members: list[int]) -> None:
        """The outer step for round r (on its fragment), then a checkpoint if r is a checkpoint round."""
        self.begin(r)
        self.sink(r)(0, 0, mean_delta.numel(), mean_delta)
        self.finish(r, members)

    # A round streamed shard by shard (`streaming`): begin, the outer step per shard as its mean
    # arrives, finish. The step is elementwise, so applying it a slice at a time gives the very
    # same bits as applying it to the whole fragment.

    def begin(self, r: int) -> None:
        if r != self.round + 1:
            raise RoundFailed(f"applying round {r} on top of round {self.round}")

    def sink(self, r: int) -> Callable[[int, int, int, torch.Tensor], None]:
        """Where round r's means go: the outer step on θ_global and the momentum [lo, hi) of the
        round's fragment, in place (distinct shards may arrive at once, on different threads)."""
        base = self.bounds(r)[0]

        def apply_shard(j: int, lo: int, hi: int, mean: torch.Tensor) -> None:
            if not outer_step(self.theta[base + lo:base + hi], self.buf[base + lo:base + hi], mean, lr=self.lr,
                              momentum=self.momentum, nesterov=self.nesterov):
                raise NonFinite(f"round {r}: the outer step made θ_global non-finite (it overflowed: training "
                                f"diverged); it is not checkpointed. Lower outer_lr or the learning rate and start a "
                                f"new run")

        return apply_shard

    def finish(self, r: int, members: list[int]) -> None:
        """Round r's outer step is applied everywhere: it is the state's round; checkpoint it if due."""
        self.round = r
        self.finished = (r, members)
        if r % self.checkpoint_every == 0:
            self._checkpoint(r, members)

    def checkpoint_last(self) -> None:
        """The run's training is over: checkpoint its last round if `checkpoint_every` left it out,
        so the store holds the final global model (`diloco export` takes it out; a longer run
        resumes from it). Shard j's reducer in that round writes its pieces, as in any checkpoint."""
        if self.finished is not None and self.finished[0] == self.round and self.round % self.checkpoint_every:
            self._checkpoint(*self.finished)

    def _checkpoint(self, r: int, members: list[int]) -> None:
        """Write this replica's pieces of checkpoint r (the shards it reduces among `members`),
        then, from one collector, delete what no rejoin needs any more."""
        roster = self.ar.roster(r)
        mine = [j for j in range(len(roster)) if reducer_of(j, members, roster) == self.io.rank]
        shards = shard_bounds(self.total, len(roster))
        for j in mine:
            piece = clip(*shards[j], self.start, self.stop)
            if piece[0] < piece[1]:
                self.checkpoints.put_piece(r, piece, self.start, self.theta, self.buf, self.ar.roster(r + 1))
        if mine:
            self.written[r] = mine
        if reducer_of(0, members, roster) == self.io.rank and self.io.lanes.leader:  # one collector, off the hot path
            self.io.pool.submit(self.checkpoints.collect_garbage, r)

    def digest(self) -> tuple[int, int]:
        """This lane's part of the state's digest (`outer.state_digest`; the replica's is `digest_of` its lanes')."""
        return state_digest(self.theta, self.buf, self.start)

    def repair_divergence(self, since: int, initial: Callable[[], torch.Tensor] | None) -> int:
        """This replica's state left the others' at round `since`: void the checkpoints it wrote
        from then on, and reload from an older one (the others' state, replayed)."""
        tainted = sorted(c for c in self.written if c >= since)
        if tainted:  # each lane voids the checkpoints it wrote shards of: a void marker voids all lanes
            self.checkpoints.void(tainted, f"written by rank {self.io.rank}, whose state diverged at round {since}")
        self.written = {c: s for c, s in self.written.items() if c < since}
        return self.bootstrap(initial, below=since)
