"""Carrying out `diloco scale` requests for the supervisor (`diloco.store.scaling` says what they mean).

Kept apart from the supervisor's restart logic, as `diloco.runrecord.roundwatch` is: it reads the
requests, decides with `scaling.plan_resize`, writes the run's new target into the store, and
asks the supervisor to launch the ranks it adds; the ranks it retires are only marked (they
leave by themselves after their round) or, if not running yet, cancelled.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..bootstrap.failures import shorten
from ..protocol import Executor
from ..runrecord.rankstate import RankState, RankStatus
from ..request import LaunchRequest
from ..store.runkeys import RunKeys, scale_seq
from ..store.scaling import ScaleRequest, pending, plan_resize, roster_body
from ..runrecord.state import RunRecord


class ResizeHost(Protocol):
    """What the resizer needs of the supervisor it works for (`diloco.supervise.supervisor.Supervisor`):
    what it reads, and what it asks of it (`event`, `add_rank`, `resized`, `launch`). It changes
    the run only through these, the `RankState` records of the ranks it retires, and the
    executor's `cancel` of a retired rank that has not started."""

    ranks: list[RankState]
    record: RunRecord
    request: LaunchRequest
    executor: Executor
    group_names: dict[int, str]

    def event(self, kind: str, **fields: Any) -> None: ...

    def add_rank(self, rank: int, group: str | None) -> None: ...

    def resized(self, active: int) -> None: ...

    def launch(self, ranks: list[int], attempt_of: dict[int, int]) -> None: ...


class Resizer:
    """Applies `diloco scale` requests to the run of `sup` (`ResizeHost`)."""

    def __init__(self, sup: ResizeHost):
        self.sup = sup
        self.applied: list[str] = list(sup.record.data.get("applied_scales") or [])

    def state(self) -> dict[str, Any]:
        return {"applied_scales": list(self.applied), "target_replicas": self.size()}

    def size(self) -> int:
        """The replicas the run is to have (its launch, as resized): every rank not retired. A
        rank given up still counts: the run has lost it, and `min_replicas` says what that costs."""
        return sum(not st.retired for st in self.sup.ranks)

    def active(self) -> list[RankState]:
        """The ranks a resize works from: not retired, not given up (a given-up rank never comes back)."""
        return [st for st in self.sup.ranks if not st.retired and not st.given_up]

    def apply_pending(self) -> bool:
        """Apply every request not applied yet, oldest first; True if there was one."""
        requests = pending(self.sup.record, self.applied)
        for req in requests:
            try:
                self._apply(req)
            finally:
                self.applied.append(req.name)  # applied, or refused with an event: never retried in a loop
        return bool(requests)

    def _apply(self, req: ScaleRequest) -> None:
        sup = self.sup
        by_group: dict[str, list[int]] = {}
        for st in self.active():
            by_group.setdefault(st.group or "g0", []).append(st.rank)
        names = [g.name for g in sup.record.spec.replica_groups()]
        group = req.group or names[0]
        if group not in names:
            sup.event("scale_refused", group=group, replicas=req.replicas, reason=f"no group {group!r}")
            return
        before = len(self.active())
        added, retired = plan_resize(by_group, len(sup.ranks), group, req.replicas)
        ranks = sorted({st.rank for st in self.active()} - set(retired) | set(added))
        if not ranks:
            sup.event("scale_refused", group=group, replicas=req.replicas, reason="it would leave no replica")
            return
        try:  # the replicas read the target from the store: it goes first, or nothing changes
            from ..store.objectstore import open_store

            store, keys = open_store(sup.request.rendezvous), RunKeys(sup.request.run_id)
            # after the newest target there, even one a launcher wrote before dying unsaved
            seqs = [scale_seq(m["path"][len(keys.roster()):]) for m in store.list(keys.roster())]
            seq = max((x for x in seqs if x is not None), default=0) + 1
            store.put(keys.scale(seq), roster_body(sup.request.run_id, seq, ranks), create_only=True)
        except Exception as exc:  # noqa: BLE001 - a store that cannot be written: one event, the run goes on
            sup.event("scale_failed", group=group, replicas=req.replicas, error=shorten(str(exc)))
            return
        for rank in retired:
            self._retire(sup.ranks[rank])
        grouped = bool(sup.group_names)
        for rank in added:
            sup.add_rank(rank, group)
        sup.resized(len(ranks))
        sup.event("scaled", group=group if grouped else None, replicas_from=before, replicas_to=len(ranks),
                   added=added, retired=retired, seq=seq)
        if added:
            sup.launch(added, {r: 0 for r in added})

    def _retire(self, st: RankState) -> None:
        """The rank leaves after the round it is in; one that is not running is stopped now."""
        st.retired = True
        if st.relaunch_at is not None:  # waiting for a relaunch that will not come
            st.relaunch_at, st.status = None, RankStatus.CANCELLED_BY_SUPERVISOR
        elif st.handle is not None and st.status is RankStatus.PENDING:  # not started: nothing of a round to lose
            self.sup.executor.cancel(st.handle)
            st.status = RankStatus.CANCELLED_BY_SUPERVISOR
