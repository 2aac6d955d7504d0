"""The supervisor: keeps a run's replicas alive through the executor protocol alone.

A DiLoCo replica meets the others only at round boundaries, through the object store, so one
dead replica can be replaced while the rest keep training (torchft/prime style), unlike torch
elastic, which restarts the whole group. Policies ([restart] table):

- ``per-rank`` (default): relaunch only the failed rank, same rank, attempt + 1; it rejoins
  the training at the next round from the global state in the store.
- ``gang``: cancel every rank and relaunch all of them as the next attempt (torch elastic's
  behaviour); also used for backends whose executor cannot relaunch one rank alone.
- ``never``: no relaunches.

Budgets: ``max_restarts`` counts relaunches across the whole run (a gang restart counts once);
``max_restarts_per_rank`` caps each rank. Relaunches back off exponentially per rank
(``backoff`` * 2^n, at most ``backoff_max``) without blocking the monitoring of other ranks.
``min_replicas`` (default: all) is how many ranks must stay alive and, at the end, have
succeeded; a rank whose budget is spent is given up, and the run goes on while enough remain.
Below that, every rank is cancelled and the run fails with each rank's last error.

Failures that relaunching cannot fix end the run at once instead of spending the budget (each
relaunch on a cloud backend costs minutes and money): a replica that stopped on a spec or
store mistake (exit 78, `diloco.errors.EXIT_CONFIG`), and the same exception at the same global
step on every rank, each within ``fail_fast_seconds`` of its start. Signals, OOM kills,
preemptions and lost nodes are always relaunched.

A preempted replica (exit 75, `diloco.errors.EXIT_PREEMPTED`: the platform took its machine
away) is not a failure of the run's code: it becomes a ``preempted`` event and is relaunched
per the policy without spending ``max_restarts`` or ``max_restarts_per_rank``; preemptions have
their own run-wide budget, ``max_preemptions``, so a platform that keeps taking machines away
cannot bill forever.

Each completed round's summary (`diloco.metrics.RoundSummary`, from the store) becomes a
``round`` event; a summary whose replicas disagree on θ becomes ``diverged``, a corrupt object a
replica met becomes ``incident``, and a run whose rounds all had a single member although it has
several replicas gets ``training_alone`` (the replicas are not meeting) and an UNHEALTHY state.
Each new summary also goes to the spec's metric sinks (`diloco.sinks`; TensorBoard by default).

All state is in the run record (handles of every attempt, budgets, status), written on every
change, so a new launcher can reattach (`diloco resume`) and continue where this one stopped.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from .failures import code_failure_signature, is_config_error, is_preemption, shorten
from .protocol import ReplicaHandle, ReplicaResult, ReplicaStatus, ServerlessExecutor
from .state import FINAL_STATES, RunRecord, process_start_ticks


HEARTBEAT_EVERY = 5.0  # seconds between record saves while nothing changes
HEARTBEAT_STALE = 30.0  # a launcher silent this long is presumed dead (`diloco resume` may take over)


class GroupState(str, Enum):
    """torch elastic's worker-group states, for the run as a whole."""

    INIT = "INIT"
    HEALTHY = "HEALTHY"
    UNHEALTHY = "UNHEALTHY"
    STOPPED = "STOPPED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    UNKNOWN = "UNKNOWN"

    @property
    def is_final(self) -> bool:
        return self.value in FINAL_STATES


class RunFailed(Exception):
    """Raised by `Supervisor.run` when the run failed; carries every rank's last error."""

    def __init__(self, message: str, errors: dict[int, str | None]):
        super().__init__(message)
        self.errors = errors


@dataclass
class RankState:
    rank: int
    handle: ReplicaHandle | None = None
    status: str = "pending"
    restarts: int = 0
    given_up: bool = False
    relaunch_at: float | None = None
    last_error: str | None = None
    result: Any = None
    history: list[dict[str, Any]] = field(default_factory=list)  # every attempt's handle
    launched_at: float | None = None     # when the current attempt was launched
    failure_signature: str | None = None  # the latest failure's cause, if training code raised it
    failed_soon: bool = False            # whether that failure came within fail_fast_seconds of launch
    preemptions: int = 0                 # times the platform took this rank's machine away
    preempted: bool = False              # the scheduled relaunch replaces a preempted attempt

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "handle": self.handle.to_dict() if self.handle else None,
                "status": self.status, "restarts": self.restarts, "given_up": self.given_up,
                "relaunch_at": self.relaunch_at, "last_error": self.last_error, "result": self.result,
                "history": self.history, "launched_at": self.launched_at,
                "failure_signature": self.failure_signature, "failed_soon": self.failed_soon,
                "preemptions": self.preemptions, "preempted": self.preempted}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankState:
        handle = ReplicaHandle.from_dict(data["handle"]) if data.get("handle") else None
        return cls(rank=data["rank"], handle=handle, status=data.get("status", "pending"),
                   restarts=data.get("restarts", 0), given_up=data.get("given_up", False),
                   relaunch_at=data.get("relaunch_at"), last_error=data.get("last_error"),
                   result=data.get("result"), history=list(data.get("history", [])),
                   launched_at=data.get("launched_at"), failure_signature=data.get("failure_signature"),
                   failed_soon=data.get("failed_soon", False), preemptions=data.get("preemptions", 0),
                   preempted=data.get("preempted", False))


@dataclass
class LaunchArgs:
    """Everything `launch_replicas` needs besides ranks and attempt (secrets excluded)."""

    n_replicas: int
    entrypoint: Any
    entrypoint_args: dict[str, Any]
    gpu: str | None
    timeout: float
    run_id: str
    rendezvous: str | None
    env: dict[str, str]
    processes_per_replica: int = 1  # (records written before it existed are single-process)

    def processes_kwargs(self) -> dict[str, int]:
        """`processes_per_replica=L` for launch/dryrun when L > 1; nothing otherwise, so executors
        that predate it still work for single-process replicas."""
        return {"processes_per_replica": self.processes_per_replica} if self.processes_per_replica > 1 else {}


class Supervisor:
    def __init__(self, executor: ServerlessExecutor, record: RunRecord, launch: LaunchArgs,
                 restart: dict[str, Any], *, secret_env: dict[str, str] | None = None,
                 on_tick: Callable[[Supervisor], None] | None = None,
                 clock: Callable[[], float] = time.time):
        self.executor = executor
        self.record = record
        self.launch = launch
        self.policy = restart.get("policy", "per-rank")
        if self.policy == "per-rank" and not getattr(executor, "supports_rank_relaunch", False):
            self.policy = "gang"
        self.max_restarts = int(restart.get("max_restarts", 10))
        self.max_per_rank = int(restart.get("max_restarts_per_rank", 3))
        self.backoff = float(restart.get("backoff", 1.0))
        self.backoff_max = float(restart.get("backoff_max", 60.0))
        self.min_replicas = int(restart.get("min_replicas") or launch.n_replicas)
        self.interval = float(restart.get("monitor_interval", 1.0))
        self.fail_fast_seconds = float(restart.get("fail_fast_seconds", 900.0))
        self.max_preemptions = int(restart.get("max_preemptions", 50))
        self.secret_env = dict(secret_env or {})
        self.on_tick = on_tick
        self.clock = clock
        saved = record.data.get("ranks")
        self.ranks = ([RankState.from_dict(r) for r in saved] if saved
                      else [RankState(r) for r in range(launch.n_replicas)])
        self.restarts_used = int(record.data.get("restarts_used", 0))
        self.preemptions_used = int(record.data.get("preemptions_used", 0))
        self.state = GroupState(record.data.get("state", GroupState.INIT.value))
        self.last_round = int(record.data.get("last_round", 0))
        self.health: dict[str, Any] = dict(record.data.get("health") or {})
        self.rounds_every = 1.0
        self._next_rounds_check = 0.0
        self._rounds = None  # RoundReader over the run's store, opened once
        self._sinks: list[Any] | None = None  # the spec's metric sinks, opened at the first round

    # -- persistence -----------------------------------------------------------------------

    def save(self) -> None:
        self.record.data.update({
            "state": self.state.value, "ranks": [r.to_dict() for r in self.ranks],
            "restarts_used": self.restarts_used, "preemptions_used": self.preemptions_used, "policy": self.policy, "last_round": self.last_round,
            "health": self.health,
            "launcher": {"pid": os.getpid(), "host": socket.gethostname(), "heartbeat": self.clock(),
                         "start_ticks": process_start_ticks(os.getpid())},
        })
        self.record.save()

    def _event(self, kind: str, **fields: Any) -> None:
        self.record.event(kind, **fields)

    # -- launching -------------------------------------------------------------------------

    def _launch(self, ranks: list[int], attempt_of: dict[int, int]) -> None:
        by_attempt: dict[int, list[int]] = {}
        for r in ranks:
            by_attempt.setdefault(attempt_of[r], []).append(r)
        for attempt, group in sorted(by_attempt.items()):
            a = self.launch
            handles = self.executor.launch_replicas(
                a.n_replicas, a.entrypoint, a.entrypoint_args, gpu=a.gpu, timeout=a.timeout,
                run_id=a.run_id, rendezvous=a.rendezvous, ranks=group, attempt=attempt,
                env=a.env, secret_env=self.secret_env, **a.processes_kwargs())
            for h in handles:
                st = self.ranks[h.rank]
                st.handle, st.status, st.relaunch_at = h, ReplicaStatus.PENDING.value, None
                st.launched_at = self.clock()
                st.history.append(h.to_dict())
            self._event("launch", ranks=group, attempt=attempt)
        self.save()

    def start(self) -> None:
        """First launch of every rank, attempt 0."""
        self._launch([r.rank for r in self.ranks], {r.rank: 0 for r in self.ranks})
        self.state = GroupState.HEALTHY
        self.save()

    # -- monitoring ------------------------------------------------------------------------

    def alive(self) -> list[RankState]:
        return [r for r in self.ranks if r.status in ("pending", "running") or r.relaunch_at is not None]

    def _rank_result(self, st: RankState) -> ReplicaResult:
        res: ReplicaResult = self.executor.collect([st.handle], timeout=0)[0]
        if not res.error and res.exit_code:
            res.error = f"exit code {res.exit_code}"
        return res

    def _record_rounds(self, *, final: bool = False) -> bool:
        """Round summaries completed since the last look, from the store, as events; True if any.

        `final`: the replicas are done, so a round whose summary never came is rebuilt from its rows.
        """
        now = self.clock()
        if (now < self._next_rounds_check and not final) or not self.launch.rendezvous:
            return False
        self._next_rounds_check = now + self.rounds_every
        from .metrics import RoundCache, RoundReader
        from .store import open_store

        if self._rounds is None:
            try:
                self._rounds = RoundReader(open_store(self.launch.rendezvous), self.launch.run_id,
                                           after=self.last_round)
            except Exception:  # unreachable from this shell: no round events, supervision goes on
                return False
        try:
            new = self._rounds.read_new(final=final)
        except Exception:
            return False
        RoundCache(self.record.dir).append(new)
        self._write_sinks(new)
        for rnd in new:
            self._event("round", round=rnd.round, members=rnd.members, loss=_rounded(rnd.loss),
                        tokens_per_s=round(rnd.tokens_per_s or 0), sync_share=_rounded(rnd.sync_share),
                        step=rnd.step, total_steps=rnd.total_steps, straggler=rnd.straggler,
                        waited_s=_rounded(rnd.waited_s))
            if rnd.diverged:
                self._event("diverged", round=rnd.round, minority=rnd.diverged["minority"],
                            majority=rnd.diverged["majority"])
            for inc in rnd.incidents:
                self._event("incident", **{k: v for k, v in inc.items() if k != "round"}, round=rnd.round)
            self._check_alone(rnd.round, rnd.members)
            self.last_round = rnd.round
        return bool(new)

    def _write_sinks(self, summaries: list[Any]) -> None:
        """Each new round to every metric sink; a sink that fails is reported once and dropped."""
        if not summaries:
            return
        if self._sinks is None:
            from .sinks import open_sinks

            metrics = (self.record.data.get("spec") or {}).get("metrics") or {}
            try:
                self._sinks = open_sinks(metrics, self.launch.run_id, self.record.dir)
            except Exception as exc:
                self._event("sink_failed", sink="*", error=shorten(str(exc)))
                self._sinks = []
        for sink in list(self._sinks):
            try:
                for summary in summaries:
                    sink.write(summary)
            except Exception as exc:
                self._event("sink_failed", sink=getattr(sink, "sink_name", "?"), error=shorten(str(exc)))
                self._sinks.remove(sink)

    def close_sinks(self) -> None:
        for sink in self._sinks or []:
            try:
                sink.close()
            except Exception:
                pass
        self._sinks = None

    def _check_alone(self, round_: int, members: list[int]) -> None:
        """A run of several replicas whose every round had one member is N unrelated trainings."""
        if self.launch.n_replicas < 2 or self.health.get("met"):
            return
        if len(members) > 1:
            self.health.pop("alone", None)
            self.health["met"] = True
            return
        if "alone" not in self.health:
            self._event("training_alone", round=round_, ranks=members,
                        reason=f"every round so far had a single member although the run has {self.launch.n_replicas} "
                               "replicas: they are not meeting in the store")
        self.health["alone"] = {"through_round": round_, "ranks": members}

    def _give_up_or_schedule(self, st: RankState, now: float) -> None:
        if self.policy == "never" or st.restarts >= self.max_per_rank or self.restarts_used >= self.max_restarts:
            st.given_up = True
            self._event("give_up", rank=st.rank, restarts=st.restarts, reason=(
                "restart policy is never" if self.policy == "never" else "restart budget spent"))
            return
        delay = min(self.backoff * (2 ** st.restarts), self.backoff_max)
        st.relaunch_at = now + delay
        self._event("relaunch_scheduled", rank=st.rank, delay=round(delay, 3), attempt=st.handle.attempt + 1)

    def tick(self) -> GroupState:
        """One monitor pass: poll every rank, react to changes, relaunch what is due."""
        now = self.clock()
        changed = self._record_rounds()
        for st in self.ranks:
            if st.handle is None or st.relaunch_at is not None or st.status in ("succeeded", "failed", "cancelled"):
                continue
            status = self.executor.poll(st.handle)
            if status.value == st.status:
                continue
            changed = True
            was, st.status = st.status, status.value
            if status is ReplicaStatus.PENDING and was == "running":  # e.g. a spot interruption the platform retries
                self._event("pending", rank=st.rank, attempt=st.handle.attempt, reason=self._why_waiting(st))
            elif status is ReplicaStatus.RUNNING:
                self._event("running", rank=st.rank, attempt=st.handle.attempt)
            elif status is ReplicaStatus.SUCCEEDED:
                st.result = self.executor.collect([st.handle], timeout=0)[0].result
                self._event("succeeded", rank=st.rank, attempt=st.handle.attempt)
            elif status is ReplicaStatus.CANCELLED:
                self._event("cancelled", rank=st.rank, attempt=st.handle.attempt)
            elif status is ReplicaStatus.FAILED:
                res = self._rank_result(st)
                st.last_error = res.error
                if is_preemption(res.exit_code):
                    self._preempted(st, now)
                    if self.policy == "gang" and st.relaunch_at is not None:
                        self._gang_restart(now, failed=st, preempted=True)
                        break
                    continue
                st.failure_signature = code_failure_signature(res.error)
                st.failed_soon = st.launched_at is None or now - st.launched_at <= self.fail_fast_seconds
                self._event("failed", rank=st.rank, attempt=st.handle.attempt, error=shorten(st.last_error))
                if is_config_error(res.exit_code):
                    return self._fail(f"rank {st.rank} stopped on a configuration error, which a relaunch would "
                                      f"repeat: {st.last_error}")
                same = self._same_code_failure_everywhere()
                if same:
                    return self._fail(f"every rank failed with the same error at the same step: {same}; not "
                                      f"relaunching (it would fail again): fix the code and start a new run")
                if self.policy == "gang":
                    self._gang_restart(now, failed=st)
                    break
                self._give_up_or_schedule(st, now)
        if (self.record.cancel_requested() or any(r.status == "cancelled" for r in self.ranks)) \
                and not self.state.is_final:
            return self._finish_cancelled()
        due = [st for st in self.ranks if st.relaunch_at is not None and st.relaunch_at <= now]
        if due:
            for st in due:
                if st.preempted:  # a preemption's relaunch is paid from max_preemptions, already counted
                    st.preempted = False
                    continue
                st.restarts += 1
                if self.policy != "gang":
                    self.restarts_used += 1
            self._launch([st.rank for st in due], {st.rank: st.handle.attempt + 1 for st in due})
            changed = True
        live = len(self.alive())
        succeeded = sum(r.status == "succeeded" for r in self.ranks)
        if live + succeeded < self.min_replicas:
            return self._fail(f"only {live + succeeded} of {self.launch.n_replicas} replicas are alive or done, "
                              f"below min_replicas={self.min_replicas}")
        if live == 0:
            self._record_rounds(final=True)  # the last rounds, before the run is declared over
            # enough succeeded: fewer would have failed the run just above
            self.state = GroupState.SUCCEEDED
            self._event("run_succeeded", succeeded=succeeded, given_up=[r.rank for r in self.ranks if r.given_up])
            changed = True
        else:
            unhealthy = any(r.relaunch_at is not None or r.given_up for r in self.ranks) or "alone" in self.health
            new_state = GroupState.UNHEALTHY if unhealthy else GroupState.HEALTHY
            changed = changed or new_state != self.state
            self.state = new_state
        if changed:
            self.save()
        return self.state

    def _why_waiting(self, st: RankState) -> str | None:
        """The executor's words for why a replica is waiting again, if it has an optional
        `status_detail(handle)` (SageMaker: "Interrupted: spot capacity was reclaimed; …")."""
        detail = getattr(self.executor, "status_detail", None)
        try:
            return detail(st.handle) if detail else None
        except Exception as exc:  # noqa: BLE001 - a reason is decoration; never stop supervising for it
            return f"(no detail: {type(exc).__name__})"

    def _preempted(self, st: RankState, now: float) -> None:
        """The platform took the rank's machine away: relaunch without spending the failure budgets."""
        self._event("preempted", rank=st.rank, attempt=st.handle.attempt, error=shorten(st.last_error))
        if self.policy == "never" or self.preemptions_used >= self.max_preemptions:
            st.given_up = True
            self._event("give_up", rank=st.rank, restarts=st.restarts, reason=(
                "restart policy is never" if self.policy == "never" else
                f"max_preemptions ({self.max_preemptions}) reached"))
            return
        self.preemptions_used += 1
        st.preemptions += 1
        st.preempted = True
        delay = min(self.backoff, self.backoff_max)
        st.relaunch_at = now + delay
        self._event("relaunch_scheduled", rank=st.rank, delay=round(delay, 3), attempt=st.handle.attempt + 1,
                    reason="preempted")

    def _same_code_failure_everywhere(self) -> str | None:
        """The shared cause if every rank's latest failure is the same exception at the same step, soon after start."""
        sigs = {st.failure_signature if st.failed_soon else None for st in self.ranks}
        if len(sigs) == 1 and None not in sigs:
            return sigs.pop()
        return None

    def _gang_restart(self, now: float, failed: RankState, *, preempted: bool = False) -> None:
        if not preempted and self.restarts_used >= self.max_restarts:
            for st in self.ranks:
                st.given_up = st.given_up or st.status == "failed"
            self._event("give_up", rank=failed.rank, restarts=self.restarts_used, reason="gang restart budget spent")
            self._stop_all()
            return
        self._event("gang_restart", failed_rank=failed.rank)
        self._stop_all()
        delay = min(self.backoff * (2 ** self.restarts_used), self.backoff_max)
        for st in self.ranks:
            st.status, st.relaunch_at, st.preempted = "failed", now + delay, preempted
        if not preempted:
            self.restarts_used += 1  # a gang restart costs the run one restart, not one per rank

    def _stop_all(self) -> None:
        for st in self.ranks:
            if st.handle is not None and st.status in ("pending", "running"):
                self.executor.cancel(st.handle)
                st.status = "cancelled_by_supervisor"

    def _fail(self, reason: str) -> GroupState:
        self._stop_all()
        for st in self.ranks:
            st.relaunch_at = None
        self.state = GroupState.FAILED
        self.record.data["failure"] = reason
        self._event("run_failed", reason=shorten(reason), errors={str(r.rank): shorten(r.last_error) for r in self.ranks})
        self.save()
        return self.state

    def _finish_cancelled(self) -> GroupState:
        self._stop_all()
        for st in self.ranks:
            st.relaunch_at = None
        self.state = GroupState.STOPPED
        self._event("run_cancelled")
        self.save()
        return self.state

    def errors(self) -> dict[int, str | None]:
        return {r.rank: r.last_error for r in self.ranks}

    def run(self, *, start: bool = True) -> GroupState:
        """Launch (unless resuming) and supervise until the run ends."""
        if start and self.state is GroupState.INIT:
            self.start()
        last_beat = self.clock()
        while True:
            state = self.tick()
            if self.on_tick:
                self.on_tick(self)
            if state.is_final:
                self.close_sinks()
                break
            if self.clock() - last_beat >= HEARTBEAT_EVERY:
                self.save()  # the heartbeat: other shells tell a live launcher from a dead one by it
                last_beat = self.clock()
            time.sleep(self.interval)
        if state is GroupState.FAILED:
            raise RunFailed(self.record.data.get("failure", "run failed"), self.errors())
        return state


def _rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 4)
