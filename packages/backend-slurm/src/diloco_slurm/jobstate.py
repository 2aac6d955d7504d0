"""What a Slurm job's state means for its replica: pure functions, table-tested (tests/test_jobstate.py).

`decide(JobFacts) -> Verdict` reads everything known about one replica attempt at once: Slurm's
view while it has one (`scontrol show job -o` while the job is in slurmctld's memory, else `sacct`
where accounting runs), the files the batch script and the runner leave in the run directory, and
whether diloco itself cancelled the job. Slurm forgets a finished job after MinJobAge and many
clusters have no accounting, so the run directory has the last word: a finished job never reads
as lost. What Slurm 22.05 reports, and what it becomes:

| Slurm | replica | exit | why |
|---|---|---|---|
| PENDING, CONFIGURING, REQUEUED, REQUEUE_HOLD, REQUEUE_FED | pending | | Reason (Priority, Resources, BeginTime: a requeue's hold) |
| SUSPENDED, STOPPED | pending | | suspended by Slurm (gang scheduling, preemption by suspension) |
| RUNNING, COMPLETING, SIGNALING, STAGE_OUT, RESIZING | running | | a COMPLETING job whose runner wrote its result reads that result |
| COMPLETED | succeeded | 0 | |
| FAILED | failed | the runner's, else ExitCode a:b → a, or 128+b | JobLaunchFailure with 0:9: the batch script was SIGKILLed |
| TIMEOUT, DEADLINE | failed | 124 | the time limit (sbatch --time) or deadline |
| PREEMPTED (not requeued) | failed | 75 | a preemption: relaunched without spending the failure budgets |
| NODE_FAIL | failed | 137 | the node failed |
| OUT_OF_MEMORY | failed | 137 | the job ran out of memory |
| BOOT_FAIL | failed | 1 | the node did not boot |
| CANCELLED | cancelled | | by diloco (its marker), or by someone else: named as such |

A requeued job (scontrol requeue, preemption with requeue) is pending again with the same job id:
no relaunch, no budget spent; the supervisor records a `pending` event with `detail`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from diloco.bootstrap.failures import signal_cause
from diloco.protocol import ReplicaStatus

WAITING = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SUSPENDED", "STOPPED"}
RUNNING = {"RUNNING", "COMPLETING", "SIGNALING", "STAGE_OUT", "RESIZING"}
ENDED_BY_SLURM = {  # state → (exit code, cause)
    "TIMEOUT": (124, "reached its Slurm time limit (TIMEOUT; sbatch --time)"),
    "DEADLINE": (124, "reached its Slurm deadline (DEADLINE)"),
    "PREEMPTED": (75, "was preempted by Slurm (PREEMPTED)"),
    "NODE_FAIL": (137, "lost its node (NODE_FAIL)"),
    "OUT_OF_MEMORY": (137, "ran out of memory (OUT_OF_MEMORY); ask for more with [backend] memory"),
    "BOOT_FAIL": (1, "did not start: its node failed to boot (BOOT_FAIL)"),
}
_FIELD = re.compile(r"(?:^|\s)([A-Za-z][\w/:]*)=(\S*)")
_BY = re.compile(r"^CANCELLED by (\S+)")


@dataclass(frozen=True)
class SlurmView:
    """Slurm's own account of a job: state, reason, ExitCode ("a:b": code a, or signal b) and restarts."""

    state: str
    reason: str = "None"
    exit_code: str = "0:0"
    restarts: int = 0
    cancelled_by: str | None = None  # sacct's "CANCELLED by <uid>"


@dataclass(frozen=True)
class JobFacts:
    """All one poll knows about a replica attempt."""

    job: str  # the job id, for the words
    slurm: SlurmView | None  # None: Slurm does not know the job (any more)
    result: dict[str, Any] | None = None  # the runner's result file
    exit_file: int | None = None  # the batch script's `.exit`
    cancelled_by_us: bool = False


@dataclass(frozen=True)
class Verdict:
    status: ReplicaStatus
    exit_code: int | None = None
    cause: str | None = None  # a failed or cancelled replica's first error line; None: the runner's own
    detail: str | None = None  # why a replica is pending, for `pending` events


def parse_scontrol(text: str) -> SlurmView | None:
    """`scontrol show job -o ID` (one line of Key=Value) as a SlurmView; None if it names no state."""
    fields = dict(_FIELD.findall(text))
    if "JobState" not in fields:
        return None
    return SlurmView(fields["JobState"], fields.get("Reason", "None"), fields.get("ExitCode", "0:0"),
                     _int(fields.get("Restarts")))


def parse_sacct(text: str) -> SlurmView | None:
    """`sacct -n -P -X -o State,ExitCode,Reason -j ID`: "CANCELLED by 1000|0:15|None"; None if empty."""
    line = next((x for x in text.splitlines() if x.strip()), None)
    if line is None:
        return None
    state, exit_code, reason = (line.split("|") + ["", ""])[:3]
    by = _BY.match(state)
    return SlurmView(state.split()[0], reason or "None", exit_code or "0:0", 0, by.group(1) if by else None)


def _int(text: str | None) -> int:
    return int(text) if text and text.isdigit() else 0


def slurm_exit_code(exit_code: str) -> int:
    """Slurm's "a:b" as a process exit code: a, or 128+b when a signal ended it."""
    code, _, sig = exit_code.partition(":")
    return 128 + _int(sig) if _int(sig) else _int(code)


def decide(facts: JobFacts) -> Verdict:
    """The replica's status, exit code and cause from what Slurm and the run directory say (table above)."""
    view, job = facts.slurm, f"Slurm job {facts.job}"
    if view is not None and view.state in WAITING:
        return Verdict(ReplicaStatus.PENDING, detail=_waiting(view, job))
    if view is not None and view.state in RUNNING:
        if facts.result is not None and view.state == "COMPLETING":
            return _from_result(facts.result)
        return Verdict(ReplicaStatus.CANCELLED if facts.cancelled_by_us else ReplicaStatus.RUNNING,
                       cause="cancelled" if facts.cancelled_by_us else None)
    if view is not None and view.state == "CANCELLED" or view is None and facts.cancelled_by_us:
        if facts.cancelled_by_us:
            return Verdict(ReplicaStatus.CANCELLED, cause="cancelled")
        who = f" by uid {view.cancelled_by}" if view and view.cancelled_by else ""
        return Verdict(ReplicaStatus.CANCELLED, cause=f"{job} was cancelled outside diloco{who} (scancel by you, "
                                                      f"another shell or an administrator)")
    if view is not None and view.state in ENDED_BY_SLURM:
        code, why = ENDED_BY_SLURM[view.state]
        return Verdict(ReplicaStatus.FAILED, code, f"{job} {why}")
    if facts.result is not None:
        return _from_result(facts.result)
    if view is not None and view.state == "COMPLETED":
        return Verdict(ReplicaStatus.SUCCEEDED, 0)
    if view is not None:  # FAILED, SPECIAL_EXIT, REVOKED or a state this code does not know
        code = slurm_exit_code(view.exit_code)
        how = signal_cause(code) or f"exited with code {code}"
        reason = f"; Slurm's reason: {view.reason}" if view.reason not in ("None", "NonZeroExitCode") else ""
        return Verdict(ReplicaStatus.FAILED, code or 1, f"{job} {view.state}: {how}{reason}")
    if facts.exit_file is not None:  # Slurm forgot the job; the batch script wrote how it ended
        code = facts.exit_file
        if code == 0:
            return Verdict(ReplicaStatus.SUCCEEDED, 0)
        how = signal_cause(code) or f"exited with code {code}"
        return Verdict(ReplicaStatus.FAILED, code, f"{job} {how} (Slurm no longer knows the job; read from its "
                                                   f"exit file)")
    return Verdict(ReplicaStatus.FAILED, None, f"{job} is lost: Slurm no longer knows it (MinJobAge passed and no "
                                               f"accounting) and it left no result or exit file in the run directory")


def _from_result(result: dict[str, Any]) -> Verdict:
    status = ReplicaStatus.SUCCEEDED if result.get("status") == "succeeded" else ReplicaStatus.FAILED
    code = result.get("exit_code")
    return Verdict(status, code if isinstance(code, int) else (0 if status is ReplicaStatus.SUCCEEDED else 1))


def _waiting(view: SlurmView, job: str) -> str:
    if view.state in ("SUSPENDED", "STOPPED"):
        return f"{job} is {view.state.lower()} by Slurm"
    again = f", requeued (restart {view.restarts})" if view.restarts or view.state.startswith("REQUEUE") else ""
    hold = "; a requeued job is held ~120 s before it may start" if view.reason == "BeginTime" else ""
    return f"{job} is {view.state.lower()}{again}: Slurm's reason: {view.reason}{hold}"
