"""Reading a DescribeTrainingJob response: the replica's status, why it is waiting, how it ended.

SageMaker's two levels (TrainingJobStatus + SecondaryStatus, docs: SecondaryStatusTransition)
map onto the protocol's five statuses:

- InProgress + Starting / LaunchingMLInstances / PreparingTrainingStack / Downloading /
  DownloadingTrainingImage / Pending / Restarting / Interrupted → pending. Interrupted is a
  managed-spot interruption SageMaker retries itself: the job stays InProgress and comes back
  through Starting, so it never reaches the supervisor as a failure and spends no restart budget;
  `detail` says what it is waiting for, and the supervisor shows that as a `pending` event.
- InProgress + Training / Uploading / Updating → running.
- Completed → succeeded. Failed → failed (FailureReason carries the replica's exit code and
  cause, written by the bootstrap to /opt/ml/output/failure).
- Stopping → running, unless diloco itself asked for the stop (`stop_requested`: then
  cancelled). SageMaker shows Stopping/Stopping both after StopTrainingJob and when a job
  reaches MaxRuntimeInSeconds or MaxWaitTimeInSeconds; only the end tells them apart, and a
  rank that reads cancelled is taken as cancelled outside diloco: one rank's timeout must be a
  time limit instead.
- Stopped + MaxRuntimeExceeded (the spec's timeout) and Stopped + MaxWaitTimeExceeded (spot
  capacity did not come back within max_wait) → failed, exit 124: a time limit, relaunched
  without spending the failure budgets (`diloco.bootstrap.failures.is_time_limit`).
- Stopped (someone called StopTrainingJob) → cancelled: unless `diloco cancel` asked, the
  supervisor relaunches that rank as cancelled outside diloco (`detail` says so).
"""

from __future__ import annotations

import re
from typing import Any

from diloco.bootstrap.failures import signal_cause
from diloco.protocol import ReplicaStatus

RUNNING_SECONDARY = {"Training", "Uploading", "Updating"}
WAITING = {
    "Interrupted": "spot capacity was reclaimed; SageMaker is waiting for capacity and will restart the job",
    "Restarting": "SageMaker is restarting the job after an interruption",
    "Starting": "SageMaker is starting the job",
    "Pending": "SageMaker is waiting for capacity",
    "LaunchingMLInstances": "SageMaker is launching the instance",
    "PreparingTrainingStack": "SageMaker is preparing the instance",
    "Downloading": "SageMaker is downloading the code and inputs",
    "DownloadingTrainingImage": "SageMaker is pulling the training image",
}
TIMED_OUT = {"MaxRuntimeExceeded": "ran past the spec's timeout (MaxRuntimeInSeconds)",
             "MaxWaitTimeExceeded": "spot capacity did not come back within [backend] max_wait (MaxWaitTimeInSeconds)"}
_EXIT = re.compile(r"exit code:? (-?\d+)")


def replica_status(job: dict[str, Any], *, stop_requested: bool = False) -> ReplicaStatus:
    """The protocol's status of a described job; `stop_requested`: diloco called StopTrainingJob on it."""
    status, secondary = job.get("TrainingJobStatus"), job.get("SecondaryStatus")
    if status == "InProgress":
        return ReplicaStatus.RUNNING if secondary in RUNNING_SECONDARY else ReplicaStatus.PENDING
    if status == "Completed":
        return ReplicaStatus.SUCCEEDED
    if status == "Stopping":
        return ReplicaStatus.CANCELLED if stop_requested else ReplicaStatus.RUNNING
    if status == "Stopped":
        return ReplicaStatus.FAILED if secondary in TIMED_OUT else ReplicaStatus.CANCELLED
    return ReplicaStatus.FAILED  # Failed, Deleting, or a status this code does not know yet


def detail(job: dict[str, Any]) -> str | None:
    """Why a job is not running right now, or who stopped it, in words (None while it trains)."""
    secondary = job.get("SecondaryStatus")
    if job.get("TrainingJobStatus") == "InProgress" and secondary in WAITING:
        interrupted = sum(t.get("Status") == "Interrupted" for t in job.get("SecondaryStatusTransitions") or [])
        text = f"{secondary}: {WAITING[secondary]}"
        return f"{text} (spot interruptions so far: {interrupted})" if interrupted else text
    if job.get("TrainingJobStatus") == "Stopped" and secondary not in TIMED_OUT:
        return (f"{job.get('TrainingJobName', 'the training job')} was stopped by a StopTrainingJob call (the console, "
                f"the AWS CLI, another tool; CloudTrail names the caller)")
    return None


def exit_code(job: dict[str, Any]) -> int | None:
    """The replica's exit code, read from FailureReason; 124 for the time limits."""
    if job.get("SecondaryStatus") in TIMED_OUT:
        return 124
    if job.get("TrainingJobStatus") == "Completed":
        return 0
    found = _EXIT.findall(job.get("FailureReason") or "")
    return int(found[-1]) if found else None


def failure_cause(job: dict[str, Any]) -> str:
    """The first line of a failed replica's error: the replica's own cause when it printed one."""
    name = job.get("TrainingJobName", "the training job")
    secondary = job.get("SecondaryStatus")
    if secondary in TIMED_OUT:
        return f"{name} {TIMED_OUT[secondary]} (exit code 124)"
    reason = (job.get("FailureReason") or "").strip()
    code = exit_code(job)
    m = re.match(r"^(?:AlgorithmError: )?exit code (-?\d+): (.+)$", reason, re.S)
    if m and m.group(2).strip():
        return m.group(2).strip().splitlines()[0]
    killed = signal_cause(code)
    if killed:
        return f"{killed} in {name}"
    return reason.splitlines()[0] if reason else f"{name} failed"
