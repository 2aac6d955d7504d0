"""How the supervisor reacts to what it learns of one rank: a new status, and an attempt that
ended without success (a failure, a preemption, a time limit, a cancel from outside diloco).

`diloco.supervise.policy` decides (pure functions); this module carries its answers out through the
supervisor's public methods (`event`, `fail`, `stop`, `stop_all`, `rank_result`), pays what they
cost from the rank's and the run's budgets (`spend`), and tells the supervisor's `on_presence`
whenever the launcher learns that a rank is not running (its attempt ended and a relaunch is
scheduled, it was given up, it is pending again, it succeeded) or that it runs again, for whoever
keeps the replicas' presence for the rounds. `diloco cancel` is not handled here: only it ends
the run, and the supervisor checks for it itself (`RunRecord.cancel_requested`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ..bootstrap.failures import shorten
from .policy import (Action, Ending, Failure, Peer, RestartSettings, RunState, Spend, cancelled_everywhere, decide,
                     spent_on_decision, ALL_CANCELLED_WINDOW)
from ..protocol import Capabilities, Executor, ReplicaResult, ReplicaStatus
from ..runrecord.rankstate import RankState, RankStatus
from ..runrecord.state import RunRecord

# on_presence(rank, attempt, present, reason, rerun): `present` False when the launcher learns that
# the rank's attempt `attempt` is not running (reason: the event that said so: "failed",
# "preempted", "time_limit", "cancelled_outside", "given_up", "pending", "succeeded",
# "gang_restart", "retired"), True when it runs ("running"). `rerun`, with "pending" only: the
# run of the attempt that ended, where the platform runs it again in place and numbers the runs
# (`Capabilities.numbered_reruns`), else None.
Presence = Callable[[int, int, bool, str, "int | None"], None]


def no_presence(rank: int, attempt: int, present: bool, reason: str, rerun: int | None = None) -> None:
    """An `on_presence` that tells nobody (a supervisor whose rounds need no presence markers)."""


class ReactionHost(Protocol):
    """What the reactions need of the supervisor they work for (`diloco.supervise.supervisor.Supervisor`):
    what they read, the run's two budgets they pay from (`restarts_used`, `preemptions_used`), and
    what they ask of it. They change the run only through these and the `RankState` records."""

    ranks: list[RankState]
    record: RunRecord
    executor: Executor  # its optional `status_detail` / `reruns` only where `capabilities` says so
    capabilities: Capabilities
    settings: RestartSettings
    restarts_used: int
    preemptions_used: int
    on_presence: Presence

    def event(self, kind: str, **fields: Any) -> None: ...

    def fail(self, reason: str) -> RunState: ...

    def stop(self, *, by: str, reason: str | None = None) -> RunState: ...

    def stop_all(self) -> None: ...

    def rank_result(self, st: RankState) -> ReplicaResult: ...


class Reactions:
    """Carries out what `diloco.supervise.policy` decides for the supervisor `sup` (`ReactionHost`)."""

    def __init__(self, sup: ReactionHost):
        self.sup = sup

    # -- a new status ----------------------------------------------------------------------

    def status_changed(self, st: RankState, status: ReplicaStatus, was: RankStatus, now: float) -> bool:
        """React to `st`'s new status (already recorded in `st.status`; it was `was`); True when
        the pass must stop looking at other ranks (the run ended, or every rank restarts)."""
        sup, attempt = self.sup, st.handle.attempt
        if status is ReplicaStatus.PENDING and was is RankStatus.RUNNING:  # a spot interruption the platform retries
            rerun = self.rerun_ended(st)
            sup.event("pending", rank=st.rank, attempt=attempt, reason=self.why_waiting(st),
                      **({"rerun": rerun + 1} if rerun is not None else {}))
            self.presence(st, False, "pending", rerun)
        elif status is ReplicaStatus.RUNNING:
            sup.event("running", rank=st.rank, attempt=attempt)
            self.presence(st, True, "running")
        elif status is ReplicaStatus.SUCCEEDED:
            st.result = sup.executor.collect([st.handle], timeout=0)[0].result
            sup.event("succeeded", rank=st.rank, attempt=attempt)
            self.presence(st, False, "succeeded")
        elif status is ReplicaStatus.CANCELLED and sup.record.cancel_requested():  # `diloco cancel`: the run ends
            sup.event("cancelled", rank=st.rank, attempt=attempt)
        elif status in (ReplicaStatus.FAILED, ReplicaStatus.CANCELLED) and st.retired:  # scaled away: not relaunched
            st.last_error = sup.rank_result(st).error
            sup.event(f"retired_{status.value}", rank=st.rank, attempt=attempt, error=shorten(st.last_error))
            self.presence(st, False, "retired")
        elif status in (ReplicaStatus.FAILED, ReplicaStatus.CANCELLED):
            return self.ended(st, now, cancelled=status is ReplicaStatus.CANCELLED)
        return False

    def why_waiting(self, st: RankState) -> str | None:
        """The executor's words for why a replica is waiting again or was cancelled, if it declares
        `status_detail` (SageMaker: "Interrupted: spot capacity was reclaimed; …")."""
        sup = self.sup
        if not sup.capabilities.status_detail:
            return None
        try:
            return sup.executor.status_detail(st.handle)
        except Exception as exc:  # noqa: BLE001 - a reason is decoration; never stop supervising for it
            return f"(no detail: {type(exc).__name__})"

    def rerun_ended(self, st: RankState) -> int | None:
        """The run of `st`'s attempt that just ended to be run again in place, if the executor
        numbers its re-runs (`Capabilities.numbered_reruns`: the next run is `reruns`); else None."""
        sup = self.sup
        if not sup.capabilities.numbered_reruns:
            return None
        try:
            reruns = sup.executor.reruns(st.handle)
        except Exception:  # noqa: BLE001 - unknown now: the rounds give the rank a grace window instead
            return None
        return reruns - 1 if isinstance(reruns, int) and not isinstance(reruns, bool) and reruns > 0 else None

    def presence(self, st: RankState, present: bool, reason: str, rerun: int | None = None) -> None:
        self.sup.on_presence(st.rank, st.handle.attempt if st.handle else 0, present, reason, rerun)

    # -- an attempt that ended without success ---------------------------------------------

    def ended(self, st: RankState, now: float, *, cancelled: bool = False) -> bool:
        """Carry out the policy's answer to `st`'s attempt that failed or (`cancelled`) was cancelled
        outside diloco (`diloco.supervise.policy.decide`); True when the pass must stop looking at other ranks
        (the run ended, or every rank restarts)."""
        sup = self.sup
        res = sup.rank_result(st)
        st.last_error = res.error
        peers = [Peer(r.failure_signature, r.failed_soon) for r in sup.ranks if r is not st and not r.retired]
        d = decide(sup.settings, Failure(res.exit_code, res.error, st.launched_at, now, cancelled=cancelled),
                   rank=st.rank, restarts=st.restarts, restarts_used=sup.restarts_used,
                   preemptions_used=sup.preemptions_used, time_limits=st.time_limits, peers=peers)
        attempt = st.handle.attempt
        if not d.ending.paid_when_decided:  # a lifecycle event says nothing of a bug in the code
            st.failure_signature, st.failed_soon = d.signature, d.failed_soon
        extra = {}
        if cancelled:
            st.cancelled_outside_at = now
            detail = self.why_waiting(st)
            extra = {"detail": shorten(detail)} if detail and detail != res.error else {}
        sup.event(d.ending.value, rank=st.rank, attempt=attempt, error=shorten(st.last_error), **extra)
        if cancelled and self.everyone_cancelled(now):
            sup.stop(by="outside diloco", reason=f"every replica of the run was cancelled outside diloco within "
                                                 f"{ALL_CANCELLED_WINDOW:g}s (scancel, StopTrainingJob, a deleted "
                                                 f"Job, ...): taken as a request to stop the whole run")
            return True
        if d.action is Action.FAIL_RUN:
            sup.fail(d.reason)
            return True
        if d.action is Action.GIVE_UP:
            st.given_up = True
            sup.event("give_up", rank=st.rank, restarts=st.restarts, reason=d.reason)
            self.presence(st, False, "given_up")
            return False
        self.spend(st, spent_on_decision(d))
        if d.action is Action.RELAUNCH:
            st.relaunch_at, st.relaunch_paid = now + d.delay, d.ending.paid_when_decided
            sup.event("relaunch_scheduled", rank=st.rank, delay=round(d.delay, 3), attempt=attempt + 1,
                      **({"reason": d.ending.value} if d.ending is not Ending.FAILED else {}))
            self.presence(st, False, d.ending.value)
            return False
        if d.action is Action.GIVE_UP_ALL:
            for r in sup.ranks:
                if r.status in (RankStatus.FAILED, RankStatus.CANCELLED) and not r.given_up:
                    r.given_up = True
                    self.presence(r, False, "given_up")
            sup.event("give_up", rank=st.rank, restarts=sup.restarts_used, reason=d.reason)
            sup.stop_all()
            return True
        self.gang_restart(now, d.delay, failed=st, paid=d.ending.paid_when_decided)
        return True

    def everyone_cancelled(self, now: float) -> bool:
        """Every rank still in the run (not retired, given up or done) was cancelled outside diloco
        within the policy's window (`diloco.supervise.policy.cancelled_everywhere`)."""
        left = [r for r in self.sup.ranks if not r.retired and not r.given_up and r.status is not RankStatus.SUCCEEDED]
        return cancelled_everywhere([r.cancelled_outside_at for r in left], now=now)

    def gang_restart(self, now: float, delay: float, failed: RankState, *, paid: bool = False) -> None:
        """Stop every rank and relaunch all (but those scaled away) after `delay`; `paid`: the cause
        was paid when decided (a preemption, a time limit), so the relaunches cost nothing more."""
        sup = self.sup
        sup.event("gang_restart", failed_rank=failed.rank)
        sup.stop_all()
        for st in sup.ranks:
            if not st.retired:  # scaled away: never relaunched, a gang restart included
                st.status, st.relaunch_at, st.relaunch_paid = RankStatus.FAILED, now + delay, paid
                self.presence(st, False, "gang_restart")

    def spend(self, st: RankState, spent: Spend) -> None:
        """Pay what the policy priced (`spent_on_decision`, `spent_on_relaunch`) from `st`'s and the run's budgets."""
        sup = self.sup
        st.restarts += spent.restarts
        st.preemptions += spent.preemptions
        st.time_limits += spent.time_limits
        sup.restarts_used += spent.run_restarts
        sup.preemptions_used += spent.preemptions
