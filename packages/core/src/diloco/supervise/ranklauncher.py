"""Starting ranks' attempts for the supervisor: the run's first launch and `diloco scale`'s new
ranks on its thread, relaunches beside its loop (`diloco.supervise.launches`).

It plans each submission (the plan `diloco run` made and a dry run showed, for the first), records
the handles that come back in the ranks' records (`RankState`) with a `launch` event, and, for a
relaunch that returns after its rank stopped waiting for it (the run ended, `diloco scale`
retired the rank), cancels the attempt at once. It works through `LaunchHost`, what it needs of
the supervisor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ..bootstrap.failures import shorten
from ..protocol import Executor, ReplicaHandle
from ..request import LaunchPlan, LaunchRequest
from ..runrecord.rankstate import RankState, RankStatus
from .launches import INLINE_WAIT_S, BackgroundLaunches, by_attempt


class LaunchHost(Protocol):
    """What launching needs of the supervisor (`diloco.supervise.supervisor.Supervisor`)."""

    ranks: list[RankState]
    executor: Executor
    request: LaunchRequest
    clock: Callable[[], float]

    def event(self, kind: str, **fields: Any) -> None: ...

    def save(self) -> None: ...


class RankLauncher:
    """Launches ranks for the supervisor `sup`; `first_plan` is the plan `diloco run` made for
    attempt 0 of every rank, submitted as it is."""

    def __init__(self, sup: LaunchHost, first_plan: LaunchPlan | None = None):
        self.sup = sup
        self.first_plan = first_plan
        self.background = BackgroundLaunches(self._submit)

    def launch(self, ranks: list[int], attempt_of: dict[int, int]) -> None:
        """Plan and submit `ranks`, each as attempt `attempt_of[rank]`, on this thread, and record
        their handles."""
        for attempt, group in by_attempt(ranks, attempt_of):
            self._record(group, attempt, self._submit(group, attempt))
        self.sup.save()

    def relaunch(self, due: list[RankState]) -> None:
        """Start the due ranks' next attempts beside the loop; record those that return soon."""
        for attempt, group in by_attempt([st.rank for st in due], {st.rank: st.handle.attempt + 1 for st in due}):
            self.background.start(group, attempt)
        self.background.wait(INLINE_WAIT_S)
        self.record_returned()

    def awaiting(self) -> list[RankState]:
        """Ranks with a relaunch scheduled and not started yet."""
        started = self.background.in_flight()
        return [st for st in self.sup.ranks if st.relaunch_at is not None and st.rank not in started]

    def in_flight(self) -> set[int]:
        """Ranks whose relaunch has been submitted and not handed back yet."""
        return self.background.in_flight()

    def record_returned(self) -> bool:
        """Record the relaunches that returned; True if any. A rank no longer waiting for its
        relaunch has its new attempt cancelled at once. A relaunch that raised raises here."""
        done = self.background.finished()
        for launch, handles in done:
            wanted = [h for h in handles if self.sup.ranks[h.rank].relaunch_at is not None]
            for h in handles:
                if h not in wanted:
                    self.sup.executor.cancel(h)
            if wanted:
                self._record([h.rank for h in wanted], launch.attempt, wanted)
        return bool(done)

    def finish(self) -> bool:
        """Wait for the relaunches in flight and record them; True if any was. One that raised
        left no attempt: it is reported (`launch_failed`) and the rest goes on."""
        self.background.wait(None)
        try:
            return self.record_returned()
        except Exception as exc:  # noqa: BLE001 - reported; nothing of it to record or cancel
            self.sup.event("launch_failed", error=shorten(str(exc)))
            return False

    def close(self) -> None:
        self.background.close()

    def _submit(self, ranks: list[int], attempt: int) -> list[ReplicaHandle]:
        """The executor's handles for `ranks` as `attempt` (the plan `diloco run` made, the first time)."""
        plan = self.first_plan
        if plan is None or (plan.request.ranks, plan.request.attempt) != (tuple(ranks), attempt):
            plan = self.sup.executor.plan(self.sup.request.for_ranks(ranks, attempt))
        self.first_plan = None  # submitted once: relaunches are planned anew
        return self.sup.executor.submit(plan)

    def _record(self, ranks: list[int], attempt: int, handles: list[ReplicaHandle]) -> None:
        for h in handles:
            st = self.sup.ranks[h.rank]
            st.handle, st.status, st.relaunch_at = h, RankStatus.PENDING, None
            st.launched_at = self.sup.clock()
            st.attempts.append(h.to_dict())
        self.sup.event("launch", ranks=ranks, attempt=attempt)
