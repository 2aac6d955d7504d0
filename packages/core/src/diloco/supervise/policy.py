"""The restart policy as pure functions: what to do about a failed attempt, what it spends, and
where the run stands after.

No processes, no clock, no I/O: the supervisor observes a failure, asks `decide`, pays
`spent_on_decision` / `spent_on_relaunch`, asks `outcome`, and carries out the answers (events,
cancels, launches). So every rule below is tested as a table of cases
(`packages/core/tests/test_policy.py`), and the supervisor's own tests only check the wiring.

The rules (the `[restart]` table, `RestartSettings`), by how an attempt ended (`Ending`):

- a replica that stopped on a spec or store mistake (exit 78) fails the run: a relaunch repeats it;
- the same exception at the same global step on every rank, each within `fail_fast_seconds` of
  its launch, fails the run: it is a bug in the code, and each relaunch costs minutes and money;
- a preemption (exit 75) is relaunched per the policy (one rank: after `backoff`) without spending
  `max_restarts` or `max_restarts_per_rank`, up to `max_preemptions` for the whole run;
- a time limit (exit 124: the spec's `timeout` or the platform's wall-time limit) is a lifecycle
  event too: relaunched per the policy at once, without spending the failure budgets, up to
  `max_time_limits_per_rank` for each rank (a replica that hangs until every limit spends it);
- an attempt cancelled outside diloco (scancel, StopTrainingJob, a deleted Job; only `diloco
  cancel` ends the run) is that rank's loss: relaunched like a failure, spending its budgets,
  except when every replica still in the run was cancelled outside within
  `ALL_CANCELLED_WINDOW` seconds (`cancelled_everywhere`): then someone meant to stop the run;
- otherwise `per-rank` relaunches the rank after `backoff * 2^restarts` (at most `backoff_max`)
  while its budgets last, `gang` restarts every rank (one restart of the run), `never` gives up.
  `per-rank` is the default because DiLoCo replicas meet only at round boundaries, through the
  store: one dead replica rejoins at the next round while the others keep training.

Budgets: `max_restarts_per_rank` caps each rank's relaunches (`per-rank`), `max_restarts` the
run's (a gang restart counts once); both are paid when the relaunch is launched, except a gang
restart's, which is paid when decided. `max_preemptions` and `max_time_limits_per_rank` are paid
when a preemption's or a time limit's relaunch is decided.

`min_replicas` (default: all) ranks must stay alive or have succeeded: a rank given up leaves the
run going with fewer while enough remain; below that the run fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from ..bootstrap.failures import code_failure_signature, is_config_error, is_preemption, is_time_limit
from ..spec.settings import RestartSettings
from ..runrecord.state import FINAL_STATES


# Every replica still in the run cancelled outside diloco within this many seconds of each other:
# someone meant to stop the whole run (`cancelled_everywhere`), not one replica.
ALL_CANCELLED_WINDOW = 60.0


class Ending(str, Enum):
    """How an attempt that did not succeed ended, as the policy reads it; the value is the event
    the supervisor records for it."""

    FAILED = "failed"                        # a crash, an OOM kill, a lost node, an error
    PREEMPTED = "preempted"                  # the platform took the machine away (exit 75)
    TIME_LIMIT = "time_limit"                # the spec's timeout or the platform's limit (exit 124)
    CANCELLED_OUTSIDE = "cancelled_outside"  # cancelled by someone or something other than diloco

    @property
    def paid_when_decided(self) -> bool:
        """A lifecycle event with a budget of its own, paid when its relaunch is decided."""
        return self in (Ending.PREEMPTED, Ending.TIME_LIMIT)


class Action(Enum):
    """What to do about a failed attempt."""

    RELAUNCH = "relaunch"          # this rank, after the decision's delay
    GANG_RESTART = "gang_restart"  # every rank, after the delay
    GIVE_UP = "give_up"            # this rank; the run goes on while min_replicas remain
    GIVE_UP_ALL = "give_up_all"    # every failed rank, and stop the others
    FAIL_RUN = "fail_run"          # the run, at once


class RunState(str, Enum):
    """The run's state in its record: torch elastic's worker-group states, for the whole run."""

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


@dataclass(frozen=True)
class Failure:
    """One attempt that ended without success, as observed: its exit code, its error text, when it
    was launched; `cancelled`: it read cancelled, and diloco did not ask (`diloco cancel` ends the
    run before any policy is asked)."""

    exit_code: int | None
    error: str | None
    launched_at: float | None
    now: float
    cancelled: bool = False

    @property
    def ending(self) -> Ending:
        if self.cancelled:
            return Ending.CANCELLED_OUTSIDE
        if is_preemption(self.exit_code, self.error):
            return Ending.PREEMPTED
        if is_time_limit(self.exit_code, self.error):
            return Ending.TIME_LIMIT
        return Ending.FAILED

    @property
    def signature(self) -> str | None:
        """The cause, if training code raised it at a known step (`diloco.bootstrap.failures`); never for an
        attempt cancelled from outside (whatever it was doing, the cancel stopped it)."""
        return None if self.cancelled else code_failure_signature(self.error)


@dataclass(frozen=True)
class Peer:
    """Another rank's latest failure, for the same-bug-everywhere rule."""

    signature: str | None
    failed_soon: bool


@dataclass(frozen=True)
class Decision:
    """What to do about one failed attempt, and what `decide` learned of it."""

    action: Action
    delay: float = 0.0
    ending: Ending = Ending.FAILED
    reason: str = ""
    signature: str | None = None  # the rank's failure signature and whether it came soon, to keep
    failed_soon: bool = False

    @property
    def preempted(self) -> bool:
        return self.ending is Ending.PREEMPTED


def decide(s: RestartSettings, failure: Failure, *, rank: int, restarts: int, restarts_used: int,
           preemptions_used: int, peers: Sequence[Peer], time_limits: int = 0) -> Decision:
    """The answer to one attempt of `rank` that ended without success (the rank has been relaunched
    `restarts` times after failures and `time_limits` times after time limits)."""
    ending = failure.ending
    if ending is Ending.PREEMPTED:
        if s.policy == "never":
            return Decision(Action.GIVE_UP, ending=ending, reason="restart policy is never")
        if preemptions_used >= s.max_preemptions:
            return Decision(Action.GIVE_UP, ending=ending, reason=f"max_preemptions ({s.max_preemptions}) reached")
        if s.policy == "gang":
            return Decision(Action.GANG_RESTART, delay=s.backoff_after(restarts_used), ending=ending)
        return Decision(Action.RELAUNCH, delay=min(s.backoff, s.backoff_max), ending=ending)
    if ending is Ending.TIME_LIMIT:  # planned, not a fault: relaunched at once
        if s.policy == "never":
            return Decision(Action.GIVE_UP, ending=ending, reason="restart policy is never")
        if time_limits >= s.max_time_limits_per_rank:
            return Decision(Action.GIVE_UP, ending=ending,
                            reason=f"max_time_limits_per_rank ({s.max_time_limits_per_rank}) reached")
        return Decision(Action.GANG_RESTART if s.policy == "gang" else Action.RELAUNCH, ending=ending)
    signature = failure.signature
    soon = failure.launched_at is None or failure.now - failure.launched_at <= s.fail_fast_seconds
    keep = {"signature": signature, "failed_soon": soon and ending is Ending.FAILED, "ending": ending}
    if is_config_error(failure.exit_code) and ending is Ending.FAILED:
        return Decision(Action.FAIL_RUN, reason=f"rank {rank} stopped on a configuration error, which a relaunch "
                                                  f"would repeat: {failure.error}", **keep)
    everyone = [Peer(signature, soon), *peers]
    sigs = {p.signature if p.failed_soon else None for p in everyone}
    if len(sigs) == 1 and None not in sigs:
        return Decision(Action.FAIL_RUN, reason=f"every rank failed with the same error at the same step: "
                                                  f"{sigs.pop()}; not relaunching (it would fail again): fix the "
                                                  f"code and start a new run", **keep)
    if s.policy == "gang":
        if restarts_used >= s.max_restarts:
            return Decision(Action.GIVE_UP_ALL, reason="gang restart budget spent", **keep)
        return Decision(Action.GANG_RESTART, delay=s.backoff_after(restarts_used), **keep)
    if s.policy == "never":
        return Decision(Action.GIVE_UP, reason="restart policy is never", **keep)
    if restarts >= s.max_restarts_per_rank or restarts_used >= s.max_restarts:
        return Decision(Action.GIVE_UP, reason="restart budget spent", **keep)
    return Decision(Action.RELAUNCH, delay=s.backoff_after(restarts), **keep)


@dataclass(frozen=True)
class Spend:
    """What a step costs: `restarts` of the rank (against `max_restarts_per_rank`), `run_restarts`
    of the run (`max_restarts`), `preemptions` of the rank and of the run (`max_preemptions`), and
    `time_limits` of the rank (`max_time_limits_per_rank`)."""

    restarts: int = 0
    run_restarts: int = 0
    preemptions: int = 0
    time_limits: int = 0


def spent_on_decision(d: Decision) -> Spend:
    """What a decision costs at once, so that the next failure's `decide` sees it spent: a preempted
    rank's relaunch (or the gang restart it causes) one preemption; a time-limited rank's one of its
    time limits; a gang restart after a failure or a cancel from outside one restart of the run,
    however many ranks it relaunches. A rank's relaunch after a failure is paid when launched
    (`spent_on_relaunch`); giving up or failing the run costs nothing."""
    if d.action not in (Action.RELAUNCH, Action.GANG_RESTART):
        return Spend()
    if d.ending is Ending.PREEMPTED:
        return Spend(preemptions=1)
    if d.ending is Ending.TIME_LIMIT:
        return Spend(time_limits=1)
    return Spend(run_restarts=1) if d.action is Action.GANG_RESTART else Spend()


def spent_on_relaunch(policy: str, *, paid: bool) -> Spend:
    """What one rank's relaunch costs when it is launched: one of the rank's restarts and, unless
    it is part of a gang restart (paid once, when decided), one of the run's; nothing when it
    replaces an attempt whose ending was paid when decided (`Ending.paid_when_decided`: a
    preemption, a time limit)."""
    if paid:
        return Spend()
    return Spend(restarts=1, run_restarts=0 if policy == "gang" else 1)


def cancelled_everywhere(cancelled_at: Sequence[float | None], *, now: float,
                         window: float = ALL_CANCELLED_WINDOW) -> bool:
    """Whether someone meant to stop the whole run: `cancelled_at` holds, for every rank still in
    the run (not retired, given up or succeeded), when its latest attempt cancelled outside diloco
    was seen (None: never), and every one of them falls within the last `window` seconds."""
    return bool(cancelled_at) and all(t is not None and now - t <= window for t in cancelled_at)


@dataclass(frozen=True)
class Outcome:
    """The run's state after a monitor pass; `reason` says why when it failed."""

    state: RunState
    reason: str = ""


@dataclass(frozen=True)
class StoreAway:
    """The store has not answered the launcher for `seconds` (`RoundWatcher.store_gone_for`);
    `limit` is `[diloco] store_outage_limit`, `store` names it and `error` is what it last said."""

    seconds: float
    limit: float
    store: str = "the store"
    error: str = ""


def outcome(min_replicas: int, *, n_replicas: int, live: int, succeeded: int, waiting: int, given_up: int,
            alone: bool, store_away: StoreAway | None = None) -> Outcome:
    """Where the run stands once every failure of the pass is answered. `live` ranks are running,
    pending or (`waiting` of them) waiting for a scheduled relaunch; `succeeded` are done;
    `given_up` were given up; `alone`: the replicas train without meeting (`RoundWatcher.alone`);
    `store_away`: the store is not answering.

    Fewer than `min_replicas` alive or done fails the run, and so does a store that has not answered
    for `store_outage_limit` (the replicas give up on it then too). None alive is success: enough
    succeeded, or the rules above would have failed it. Otherwise the run goes on, UNHEALTHY while
    it waits for a relaunch or the store, goes on with fewer, or trains alone."""
    if live + succeeded < min_replicas:
        return Outcome(RunState.FAILED, f"only {live + succeeded} of {n_replicas} replicas are alive or done, "
                                        f"below min_replicas={min_replicas}")
    if live == 0:
        return Outcome(RunState.SUCCEEDED)
    away = store_away is not None and store_away.seconds > 0
    if away and store_away.seconds >= store_away.limit:
        return Outcome(RunState.FAILED, f"{store_away.store} has not answered for {store_away.seconds:.0f} s "
                                        f"(store_outage_limit = {store_away.limit:g} s): {store_away.error}")
    return Outcome(RunState.UNHEALTHY if waiting or given_up or alone or away else RunState.HEALTHY)
