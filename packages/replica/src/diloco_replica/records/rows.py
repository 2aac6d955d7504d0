"""A replica's rows: what it did in each round, as the launcher's live bar, timeline and summaries
read it (`diloco.store.metrics.RoundMetrics`).

A round's row is begun when the round ends here (`keep`: a member's, or a non-member's that caught
up) and finished with the training loop's own timings once the model holds the round (`applied`);
it is written in the background, overlapping the next inner steps, with the digest of the
replica's whole state (every lane's part of it: `outer.digest_of`), equal on every replica
whatever its lane count, so a divergence in any lane shows. The next round waits for it
(`settle`): its lane exchange shares the lanes' group, and its digest is of the state before the
next outer step.

A replica that joins a run past its first round (relaunched, re-run, added by `diloco scale`)
writes a row of the round it starts from, as a non-member (`record_held`: this attempt put
nothing into that round), unless its rank has a row of that round already. Rows are written
after a round is applied, so a round whose members all died in that instant, with no
non-member holding it, would otherwise have no row at all, although its state is in the store
and the run went on from it (a gang restart after a shared failure, a one-member round).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future

from diloco.bootstrap.context import ReplicaContext
from diloco.store.metrics import RoundMetrics

from ..round.allreduce import StoreAllReduce
from ..outer.globalstate import GlobalState
from ..round.lanes import Lanes, PeerLost
from ..outer.step import digest_of
from .recorder import Recorder


class RoundRows:
    def __init__(self, ctx: ReplicaContext, lanes: Lanes, state: GlobalState, allreduce: StoreAllReduce, *,
                 log: Callable[[str], None]):
        self.ctx, self.lanes, self.state, self.allreduce, self.log = ctx, lanes, state, allreduce, log
        self.recorder = Recorder(allreduce, log)
        self._alone_since_start = ctx.world_size > 1  # until a round with another member is seen
        self._pending: Future | None = None           # the last round's record, being written
        self._unrecorded: dict[int, RoundMetrics] = {}  # rows waiting for the training loop's timings

    def keep(self, row: RoundMetrics) -> None:
        """A round's row, to be finished and written once the model holds the round (`applied`)."""
        self._warn_if_alone(row)
        self._unrecorded[row.round] = row

    def applied(self, r: int, *, sync_s: float, outer_s: float, hidden_s: float) -> None:
        """The training process put round r into the model, losing `sync_s` to it (`outer_s`: the
        whole outer phase, this side's end of the outer step and the copy into the model): finish its row
        and write it in the background (θ and the momentum stay as they are until the next
        round's outer step, so their digest overlaps the next inner steps)."""
        row = self._unrecorded.pop(r, None)
        if row is None:
            return
        row.sync_s, row.hidden_s, row.t = sync_s, hidden_s, time.time()
        row.phases["outer"] = outer_s
        self.settle()
        self._pending = self.allreduce.io.pool.submit(self._record, row)

    def record_held(self, stride: int, total_steps: int | None) -> None:
        """(Every lane, at once, as the replica joins) the row of the round whose state it starts
        from, as a non-member. Create-only (`Recorder.write_row`): a row this rank wrote as a member of that
        round stays. Nothing for round 0 (no round yet), nor for a round whose decision the store
        no longer holds (a row names its round's members, and they are unknown)."""
        c = self.state.round
        if c == 0:
            return

        def members() -> list[int] | None:
            decided = self.allreduce.membership.read(c)
            return decided.members if decided is not None else None

        try:
            held_by = self.lanes.on_leader(members)  # one answer for every lane: all write, or none
        except PeerLost:  # another lane of this replica is gone: the replica fails, as anywhere else
            raise
        except Exception as exc:  # rows are for people; never fail a join over one
            self.log(f"could not read round {c}'s members for this replica's row: {exc}")
            return
        if held_by is None:
            return
        self.settle()
        self._record(RoundMetrics(round=c, rank=self.ctx.rank, attempt=self.ctx.attempt, members=held_by,
                                  member=False, t=time.time(), step=c * stride, total_steps=total_steps))

    def _record(self, row: RoundMetrics) -> None:
        """Write the replica's row for the round: one per replica (lane 0 writes it), with the
        digest of its whole state and every lane's incidents."""
        lanes = self.lanes.exchange({"digest": list(self.state.digest()), "incidents": row.incidents})
        if self.lanes.leader:
            row.state_digest = digest_of([lane["digest"] for lane in lanes])
            row.incidents = [i for lane in lanes for i in lane["incidents"]]
            self.recorder.write_row(row)
            self.recorder.maybe_summarize(row.round, row.members)

    def settle(self) -> None:
        """Wait for the last round's record (its lane exchange shares the lanes' group)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def _warn_if_alone(self, row: RoundMetrics) -> None:
        if not self._alone_since_start or not self.lanes.leader:  # one warning per replica
            return
        if len(row.members) > 1:
            self._alone_since_start = False
            return
        self.log(f"WARNING: round {row.round}: this replica has been alone in every round so far although the run "
                 f"has {self.ctx.world_size} replicas; they are not meeting in the store "
                 f"{self.allreduce.store.store.uri!r} (is it the same store for all of them?)")

    def close(self) -> None:
        """The replica leaves: its last row written, and no summary waits for rows any longer."""
        self.settle()
        self.recorder.closing.set()
