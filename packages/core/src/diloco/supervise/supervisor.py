"""The supervisor: keeps a run's replicas alive through the executor protocol alone.

It observes (polls every rank), has `diloco.supervise.reactions.Reactions` answer each change (a failure, a
preemption, a time limit, a cancel from outside diloco: what `diloco.supervise.policy` decides, what it
spends), asks `diloco.supervise.policy.outcome` where the run stands, and carries out the rest: launches,
and the run's end. Only `diloco cancel` / `Run.cancel()` (the record's cancel marker) ends the run
as cancelled. A relaunch is scheduled, not slept on, so one rank's backoff never holds up watching
the others, and submitted beside the loop (`diloco.supervise.ranklauncher`), so a slow launch never
does either. Rounds are watched by `diloco.runrecord.roundwatch.RoundWatcher` (events, metric sinks,
`training_alone`), `diloco scale` requests carried out by `diloco.supervise.resizer.Resizer`.

All state is in the run record (handles of every attempt, budgets, status), written on every
change, so a new launcher can reattach (`diloco resume`) and continue where this one stopped.
"""

from __future__ import annotations

import errno
import os
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ..store.awayboard import AwayBoard
from ..inputs.envvars import ENV_SETTINGS
from ..errors import BackendError, StateDirFull
from ..bootstrap.failures import shorten
from .policy import RestartSettings, RunState, StoreAway, outcome, spent_on_relaunch
from ..protocol import Executor, ReplicaResult, ReplicaStatus
from ..runrecord.rankstate import RankState, RankStatus
from .reactions import Presence, Reactions
from ..request import LaunchPlan, LaunchRequest
from ..runrecord.roundwatch import RoundWatcher
from ..spec.settings import DilocoSettings
from ..host.procinfo import started_at
from .ranklauncher import RankLauncher
from .resizer import Resizer
from ..runrecord.state import RunRecord


HEARTBEAT_EVERY = 5.0  # seconds between record saves while nothing changes
HEARTBEAT_STALE = 30.0  # a launcher silent this long is presumed dead (`diloco resume` may take over)
# A control plane that cannot answer (throttling past the SDK's retries, a network blip) leaves
# every rank's last known status standing; only an outage this long stops the launcher (the
# replicas keep running, and `diloco resume` reattaches).
POLL_OUTAGE_LIMIT = 900.0


class RunFailed(Exception):
    """Raised by `Supervisor.run` when the run failed; carries every rank's last error."""

    def __init__(self, message: str, errors: dict[int, str | None]):
        super().__init__(message)
        self.errors = errors


class Supervisor:
    """Keeps one run's replicas alive. `request` is the run's launch (every rank, attempt 0, the
    secrets from this shell); `first_plan`, when given, is the plan `diloco run` made (and a dry
    run would print) for it, submitted as is by `start`."""

    def __init__(self, executor: Executor, record: RunRecord, request: LaunchRequest,
                 restart: dict[str, Any], *, first_plan: LaunchPlan | None = None,
                 on_tick: Callable[[Supervisor], None] | None = None,
                 clock: Callable[[], float] = time.time):
        self.executor = executor
        self.capabilities = executor.capabilities
        self.record = record
        self.request = request
        self.settings = RestartSettings.from_table(restart, request.n_replicas,
                                                   relaunches_one_rank=self.capabilities.relaunches_one_rank)
        self.on_tick = on_tick
        self.clock = clock
        saved = record.data.get("ranks")
        self.ranks = ([RankState.from_dict(r) for r in saved] if saved
                      else [RankState(r) for r in range(request.n_replicas)])
        self.group_names = record.rank_groups  # empty for a one-backend run
        for st in self.ranks:
            st.group = self.group_names.get(st.rank)
        self.restarts_used = int(record.data.get("restarts_used", 0))
        self.preemptions_used = int(record.data.get("preemptions_used", 0))
        self.state = RunState(record.data.get("state", RunState.INIT.value))
        if len(self.ranks) > request.n_replicas:  # resumed after `diloco scale` added ranks
            self.request = request = replace(request, n_replicas=len(self.ranks))
        self.rounds = RoundWatcher(record, rendezvous=request.rendezvous, run_id=request.run_id,
                                   n_replicas=sum(not r.retired for r in self.ranks), clock=clock)
        self.store_outage_limit = DilocoSettings.from_env(request.env.get(ENV_SETTINGS)).store_outage_limit
        self.resizer = Resizer(self)  # `diloco scale` requests
        self.reactions = Reactions(self)  # what each rank's new status gets
        # told whenever a rank stops or starts running (`diloco.supervise.reactions.Presence`): an attempt that
        # ended is marked away in the store, so no round waits for it (`diloco.store.presence`)
        self.away = AwayBoard(request.rendezvous, request.run_id)
        self.on_presence: Presence = self._mark_presence
        self._outage_since: dict[str, float] = {}  # by group: one backend's outage is timed on its own
        self.lease: Any = None  # a diloco.supervise.lease.SupervisorLease while this supervisor runs
        self.launcher = RankLauncher(self, first_plan)  # relaunches beside this loop

    def _mark_presence(self, rank: int, attempt: int, present: bool, reason: str, rerun: int | None = None) -> None:
        problem = self.away.on_presence(rank, attempt, present, reason, rerun)
        if problem is not None:  # the rounds fall back on their grace window; said once per rank and attempt
            self.event("presence_failed", rank=rank, attempt=attempt, error=shorten(problem))

    # -- persistence -----------------------------------------------------------------------

    def save(self) -> None:
        self.record.data.update({
            "state": self.state.value, "ranks": [r.to_dict() for r in self.ranks],
            "restarts_used": self.restarts_used, "preemptions_used": self.preemptions_used, "policy": self.settings.policy,
            **self.rounds.state(), **self.resizer.state(),
            "launcher": {"pid": os.getpid(), "host": socket.gethostname(), "heartbeat": self.clock(),
                         "started": started_at(os.getpid())},
        })
        self.record.save()

    def event(self, kind: str, **fields: Any) -> None:
        """Record an event; in a run across backends, one about a rank names its group."""
        if self.group_names:  # a run across backends: every event about a rank names its group
            if "rank" in fields:
                fields["group"] = self.group_names.get(fields["rank"])
            elif "ranks" in fields:
                fields["groups"] = sorted({self.group_names.get(r) for r in fields["ranks"]} - {None})
        self.record.event(kind, **fields)

    # -- resizing (`diloco.supervise.resizer.ResizeHost`) ----------------------------------------------

    def add_rank(self, rank: int, group: str | None) -> None:
        """Take in a rank `diloco scale` adds (the resizer launches it): in a run across backends,
        recorded with its group and assigned to that group's backend."""
        self.ranks.append(RankState(rank, group=group if self.group_names else None))
        if self.group_names:
            self.record.data.setdefault("scaled_ranks", {})[str(rank)] = group
            self.group_names[rank] = group
            self.executor.assign(rank, group)  # a run across backends has a `diloco.launching.groupexec.GroupExecutor`
        self.request = replace(self.request, n_replicas=len(self.ranks))  # every rank id is below it

    def resized(self, active: int) -> None:
        """The run has `active` replicas now: its rounds are checked against that many."""
        self.rounds.n_replicas = active

    # -- launching -------------------------------------------------------------------------

    @property
    def policy(self) -> str:
        return self.settings.policy

    def launch(self, ranks: list[int], attempt_of: dict[int, int]) -> None:
        """Plan and submit `ranks`, each as attempt `attempt_of[rank]`, and record their handles."""
        self.launcher.launch(ranks, attempt_of)

    def start(self) -> None:
        """First launch of every rank, attempt 0."""
        self.launch([r.rank for r in self.ranks], {r.rank: 0 for r in self.ranks})
        self.state = RunState.HEALTHY
        self.save()

    # -- monitoring ------------------------------------------------------------------------

    def alive(self) -> list[RankState]:
        return [r for r in self.ranks if r.status.live or r.relaunch_at is not None]

    def rank_result(self, st: RankState) -> ReplicaResult:
        """How `st`'s current attempt ended (its error says why, even when only an exit code does)."""
        res: ReplicaResult = self.executor.collect([st.handle], timeout=0)[0]
        if not res.error and res.exit_code:
            res.error = f"exit code {res.exit_code}"
        return res

    def _poll(self, st: RankState) -> ReplicaStatus | None:
        """The rank's status, or None while the backend cannot say (see POLL_OUTAGE_LIMIT): a
        `poll_failed` event marks the start of an outage, `poll_recovered` its end. In a run
        across backends each group's backend has its own outage: one that answers does not end
        another's, and one that never answers is not hidden by the others."""
        group = st.group or ""
        try:
            status = self.executor.poll(st.handle)
        except BackendError as exc:
            now = self.clock()
            if group not in self._outage_since:
                self._outage_since[group] = now
                self.event("poll_failed", rank=st.rank, error=shorten(str(exc)))
            since = self._outage_since[group]
            if now - since > POLL_OUTAGE_LIMIT:
                raise BackendError(f"{exc} (the backend has not answered for {now - since:.0f}s; the "
                                   f"replicas keep running: `diloco resume {self.record.run_id}` reattaches)") from None
            return None
        since = self._outage_since.pop(group, None)
        if since is not None:
            self.event("poll_recovered", after_seconds=round(self.clock() - since, 1),
                        **({"group": group} if group else {}))
        return status

    def tick(self) -> RunState:
        """One monitor pass: poll every rank, react to changes, relaunch what is due."""
        now = self.clock()
        changed = self.launcher.record_returned()
        changed = self.rounds.poll() or changed
        changed = self.resizer.apply_pending() or changed
        for st in self.ranks:
            if st.handle is None or st.relaunch_at is not None or st.status.ended \
                    or st.status is RankStatus.CANCELLED_BY_SUPERVISOR:  # stopped on purpose: it reads cancelled
                continue
            status = self._poll(st)
            if status is None or status.value == st.status:
                continue
            changed = True
            was, st.status = st.status, RankStatus.of(status)
            stop = self.reactions.status_changed(st, status, was, now)
            if self.state.is_final:
                return self.state
            if stop:
                break  # every rank restarts or gives up: the other ranks' statuses are moot
        if self.record.cancel_requested() and not self.state.is_final:  # only `diloco cancel` ends the run so
            return self.stop(by="diloco cancel")
        due = [st for st in self.launcher.awaiting() if st.relaunch_at <= now]
        if due:
            for st in due:
                self.reactions.spend(st, spent_on_relaunch(self.settings.policy, paid=st.relaunch_paid))
                st.relaunch_paid = False
            self.launcher.relaunch(due)
            changed = True
        succeeded = sum(r.status is RankStatus.SUCCEEDED and not r.retired for r in self.ranks)  # a retired one left
        size = self.resizer.size()  # `diloco scale` moves the run's size: min_replicas follows it down
        o = outcome(min(self.settings.min_replicas, size), n_replicas=size, live=len(self.alive()),
                    succeeded=succeeded, waiting=sum(r.relaunch_at is not None for r in self.ranks),
                    given_up=sum(r.given_up for r in self.ranks), alone=self.rounds.alone,
                    store_away=self._store_away())
        if o.state is RunState.FAILED:
            return self.fail(o.reason)
        if o.state is RunState.SUCCEEDED:
            self.rounds.poll(final=True)  # the last rounds, before the run is declared over
            self.event("run_succeeded", succeeded=succeeded, given_up=[r.rank for r in self.ranks if r.given_up])
            changed = True
        changed = changed or o.state != self.state
        self.state = o.state
        if changed:
            self.save()
        return self.state

    def _store_away(self) -> StoreAway | None:
        """The store not answering the launcher, if it is not (`RoundWatcher.store_gone_for`)."""
        gone = self.rounds.store_gone_for()
        if not gone:
            return None
        error = (self.rounds.health.get("store_unreachable") or {}).get("error", "")
        return StoreAway(gone, self.store_outage_limit, f"the store {self.request.rendezvous!r}", error)

    def stop_all(self) -> None:
        """Cancel every live attempt, a relaunch in flight included once it returns; each reads
        `cancelled_by_supervisor` from here on."""
        self.launcher.finish()
        for st in self.ranks:
            if st.handle is not None and st.status.live:
                self.executor.cancel(st.handle)
                st.status = RankStatus.CANCELLED_BY_SUPERVISOR

    def fail(self, reason: str) -> RunState:
        """End the run as FAILED, saying why, with every rank's last error."""
        self.stop_all()
        for st in self.ranks:
            st.relaunch_at = None
        self.state = RunState.FAILED
        self.record.data["failure"] = reason
        self.event("run_failed", reason=shorten(reason), errors={str(r.rank): shorten(r.last_error) for r in self.ranks})
        self.save()
        return self.state

    def stop(self, *, by: str, reason: str | None = None) -> RunState:
        """End the run as STOPPED: cancelled `by` `diloco cancel`, or (`reason` says why) from outside diloco."""
        self.stop_all()
        for st in self.ranks:
            st.relaunch_at = None
        self.state = RunState.STOPPED
        if reason:
            self.record.data["stopped_because"] = reason
        self.event("run_cancelled", by=by, **({"reason": reason} if reason else {}))
        self.save()
        return self.state

    def errors(self) -> dict[int, str | None]:
        return {r.rank: r.last_error for r in self.ranks}

    def take_lease(self) -> None:
        """Become the run's one supervisor (`diloco.supervise.lease`), or raise `LeaseHeld` naming the one
        that is; `run` takes it itself, callers take it first to refuse before recording anything."""
        if self.lease is None:
            from .lease import SupervisorLease

            self.lease = SupervisorLease.acquire(self.record.dir, run_id=self.record.run_id)

    def release_lease(self) -> None:
        """Give the run's lease up (another launcher may then supervise it): at the end of `run`, or
        by a caller that took it and could not start."""
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    def run(self, *, start: bool = True) -> RunState:
        """Launch (unless resuming) and supervise until the run ends, holding the run's lease."""
        self.take_lease()
        try:
            return self._run(start=start)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise StateDirFull(f"the state directory {self.record.dir.parent.parent} is full ({exc.strerror}): "
                               f"this launcher stops and the replicas train on; free space, then "
                               f"`diloco resume {self.record.run_id}`") from None
        finally:
            self.rounds.close()  # the sinks get the last rounds
            # a relaunch in flight as supervision ends (Ctrl-C, an error) is recorded, so `diloco
            # resume` and `diloco cancel` find its attempt; not over a launcher that took over
            if self.launcher.finish() and not self.lease.lost:
                self.save()
            self.launcher.close()
            self.release_lease()

    def _run(self, *, start: bool) -> RunState:
        if start and self.state is RunState.INIT:
            self.start()
        last_beat = self.clock()
        while True:
            if self.lease is not None and self.lease.lost:
                from .lease import LeaseHeld

                raise LeaseHeld(f"run {self.record.run_id}: another launcher took over supervision while this one "
                                f"was stalled past its lease; this one stops (the replicas carry on under it)")
            state = self.tick()
            if self.on_tick:
                self.on_tick(self)
            if state.is_final:
                break
            if self.clock() - last_beat >= HEARTBEAT_EVERY:
                self.save()  # the heartbeat: other shells tell a live launcher from a dead one by it
                last_beat = self.clock()
            # a relaunch starts when it falls due, not at the next look
            due_in = [st.relaunch_at - self.clock() for st in self.launcher.awaiting()]
            time.sleep(max(0.0, min([self.settings.monitor_interval, *due_in])))
        if state is RunState.FAILED:
            raise RunFailed(self.record.failure or "run failed", self.errors())
        return state

