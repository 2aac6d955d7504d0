"""Gathering a round's reduced shards, taking over any whose reducer died.

Every lane downloads the reduced shards it holds a piece of and did not reduce itself, and hands
its piece of each to the sink. One whose reducer died is taken over by exactly one waiting
replica — whoever wins the create-only ``r/claim/j.<g>`` — while the rest keep waiting for its
result; a claimant that dies too is replaced by generation g+1. A reducer is known dead when the
launcher has marked the incarnation that was the round's member away (`diloco.presence`, read every
`PRESENCE_EVERY` seconds while shards are missing), so its shards are taken over at once; without
that word (the launcher is down) a shard is taken over once it has not appeared within the
round timeout. A corrupt shard is repaired by its reducer
(`repairs.RepairDesk.read_reduced`).

Each shard is fetched, verified, decoded and handed to the round's sink on a pool thread, at
most `window` at once, so checksums and the outer step overlap with waiting for the others and
no more than `window` reduced shards are held.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import wait

from .membership import PRESENCE_EVERY, Membership
from .reduce import ShardReducer
from .repairs import RepairDesk
from .rounderrors import RoundFailed
from .roundio import RoundIO
from .roundstate import Round
from .streaming import RoundSink, Window


class Gatherer:
    """Brings every reduced shard of a round to its sink (one per replica and lane), reducing the
    shards it takes over with `reducer` (the replica's own `ShardReducer`)."""

    def __init__(self, io: RoundIO, membership: Membership, repairs: RepairDesk, reducer: ShardReducer, *,
                 window: int):
        self.io, self.membership, self.repairs, self.reducer, self.window = io, membership, repairs, reducer, window

    def _gone(self, rnd: Round, wanted: list[int], generation: dict[int, int]) -> list[int]:
        """The shards of `wanted` still with their first reducer (generation 0) whose incarnation the
        launcher saw end (one LIST of the presence markers, a poll)."""
        first = [j for j in wanted if generation[j] == 0]
        if not first:
            return []
        with self.io.store.polling():
            presence = self.membership.rosters.look()[1]
        out = []
        for j in first:
            k = rnd.reducer(j)[0]
            if k in rnd.incarnations and presence.away.get(k, -1) >= rnd.incarnations[k]:
                out.append(j)
        return out

    def gather(self, rnd: Round, sink: RoundSink, have: set[int]) -> None:
        """Hand `sink` every reduced shard of `rnd` not in `have`; a shard that never appears and
        whose claim this replica wins is reduced here (`ShardReducer.reduce`, a takeover; added to
        `rnd.takeovers`).

        A replay (`rnd.replay`) knows the round complete, so a shard missing now was
        garbage-collected under it: it rejoins at once (`FellBehind`) instead of waiting out the
        timeout.
        """
        io = self.io
        wanted = [j for j in rnd.mine() if j not in have]  # the shards this lane holds a piece of
        generation = {j: 0 for j in wanted}
        gate = Window(self.window * rnd.cut.parts)  # `window` shards' worth of parts

        def read_to_sink(j: int) -> None:
            try:
                rnd.deliver(sink, j, self.repairs.read_reduced(rnd, j))
            finally:
                gate.release()

        def submit(j: int):
            gate.acquire()  # here, not in the task: no pool thread ever waits for the gate, so the
            return io.pool.submit(read_to_sink, j)  # downloads of this replica's own reductions never queue behind one

        pending: list = []
        try:
            self._gather(rnd, wanted, generation, submit, pending, sink)
        finally:  # no sink task outlives the round: a rejoin next loads θ and the momentum in place
            wait(pending)
        for f in pending:
            f.result()

    def _gather(self, rnd: Round, wanted: list[int], generation: dict[int, int], submit: Callable,
                pending: list, sink: RoundSink) -> None:
        """`gather`'s loop: every shard of `wanted` submitted (into `pending`) or taken over."""
        io, r = self.io, rnd.r
        prefix = io.keys.reduced(r)
        while wanted:
            poll = io.poll(f"round {r}'s reduced shards", wake=rnd.stop)
            looked, gone = io.clock(), []
            for look in poll:
                with io.store.polling(look > 0):  # re-listing after a wait is a poll
                    present = io.present(prefix)
                found = [j for j in wanted if j in present]
                pending += [submit(j) for j in found]
                wanted = [j for j in wanted if j not in present]
                if not wanted:
                    break
                if found and rnd.cut.parts > 1:  # parts arrive one after another, while the reducers work: look
                    poll.renew()  # again soon, not at poll_max, and time out only after a round_timeout without one
                if rnd.replay:
                    self.membership.check_not_collected(r)
                if io.clock() - looked >= PRESENCE_EVERY and not rnd.replay:
                    looked, gone = io.clock(), self._gone(rnd, wanted, generation)
                    if gone:
                        break
            if rnd.stop.is_set():  # this replica's own reduction failed: the round fails with it
                break
            for j in list(gone or wanted):  # its reducer (or the last claimant) never published
                if not io.put(io.keys.claim(r, j, generation[j]), str(io.rank).encode(), create_only=True):
                    generation[j] += 1  # someone else claimed it: wait for their result, then claim the next
                    continue
                io.log(f"round {r}: reduced shard {j} " + ("has no reducer left (its incarnation ended)" if gone else
                       f"did not appear in {io.round_timeout:g}s") + "; reducing it here")
                rnd.deliver(sink, j, self.reducer.reduce(rnd, j, takeover=True))
                rnd.takeovers.append(j)
                wanted.remove(j)
            if wanted and all(generation[j] > len(rnd.members) for j in wanted):
                raise RoundFailed(f"round {r}: reduced shards {wanted} never appeared")
