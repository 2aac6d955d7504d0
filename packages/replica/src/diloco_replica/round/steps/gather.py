"""Finding a round's reduced shards as they are published, taking over any whose reducer died.

Every lane needs the reduced shards it holds a piece of and did not reduce itself. The gatherer
lists the round's reduced shards until each of them is there and says so shard by shard
(`Arrival`), so the caller can read each one while the others are still awaited. One whose
reducer died is taken over by exactly one waiting replica — whoever wins the create-only
``r/claim/j.<g>`` — while the rest keep waiting for its result; a claimant that dies too is
replaced by generation g+1. A reducer is known dead when the launcher has marked the incarnation
that was the round's member away (`diloco.store.presence`, read every `PRESENCE_EVERY` seconds while
shards are missing), so its shards are taken over at once; without that word (the launcher is
down) a shard is taken over once it has not appeared within the round timeout.

The gatherer reads no shard itself: reading (and asking for a repair of a corrupt one) and
keeping what this replica published are the caller's (`allreduce`, through the one
`repairs.RepairDesk`), so data flows one way, from here to there.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from .membership import PRESENCE_EVERY, Membership
from .reduce import Reduction, ShardReducer
from ..errors import RoundFailed
from ..io import RoundIO
from ..state import Round


@dataclass(frozen=True)
class Arrival:
    """Shard j can be read now (`taken_over` None: it is published), or this replica took it
    over and reduced it (`taken_over`: what that came to)."""

    j: int
    taken_over: Reduction | None = None


class Gatherer:
    """Says when each reduced shard of a round can be read (one per replica and lane), reducing
    the shards it takes over with `reducer` (the replica's own `ShardReducer`)."""

    def __init__(self, io: RoundIO, membership: Membership, reducer: ShardReducer):
        self.io, self.membership, self.reducer = io, membership, reducer

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

    def arrivals(self, rnd: Round, have: set[int]) -> Iterator[Arrival]:
        """Every shard of `rnd` this lane holds a piece of and not in `have`, once each, as it is
        published or taken over here (`ShardReducer.reduce`, a takeover; added to `rnd.takeovers`).

        A replay (`rnd.replay`) knows the round complete, so a shard missing now was
        garbage-collected under it: it rejoins at once (`FellBehind`) instead of waiting out the
        timeout.
        """
        io, r = self.io, rnd.r
        wanted = [j for j in rnd.mine() if j not in have]
        generation = {j: 0 for j in wanted}
        prefix = io.keys.reduced(r)
        while wanted:
            poll = io.poll(f"round {r}'s reduced shards", wake=rnd.stop)
            looked, gone = io.clock(), []
            for look in poll:
                with io.store.polling(look > 0):  # re-listing after a wait is a poll
                    present = io.present(prefix)
                found = [j for j in wanted if j in present]
                wanted = [j for j in wanted if j not in present]
                yield from (Arrival(j) for j in found)
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
                reduction = self.reducer.reduce(rnd, j, takeover=True)
                rnd.takeovers.append(j)
                wanted.remove(j)
                yield Arrival(j, reduction)
            if wanted and all(generation[j] > len(rnd.members) for j in wanted):
                raise RoundFailed(f"round {r}: reduced shards {wanted} never appeared")
