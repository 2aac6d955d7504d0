"""Where the test control plane keeps a training job: one directory of JSON files per job.

Every process (the control plane, a job's instance process, a second shell's launcher) reads
the same files, so a job outlives the process that created it:

- `request.json`: the CreateTrainingJob request as received (plus ARN and creation time);
- `state.json`: statuses, transitions, timings and each instance's container pid, written by
  the job's process (`instance`);
- `stop.request` / `interrupt.request` / `expire.request`: what the instance is asked to do,
  left as files so a request that arrives while the instance is still starting is not lost.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from diloco.testing import process_alive
from diloco.testing.jsonfiles import read_json, write_json

ACCOUNT = "123456789012"
STOP_REQUEST, INTERRUPT_REQUEST, EXPIRE_REQUEST = "stop.request", "interrupt.request", "expire.request"

__all__ = ["ACCOUNT", "EXPIRE_REQUEST", "INTERRUPT_REQUEST", "STOP_REQUEST", "describe", "job_dir", "pids", "read_json", "summary",
           "write_json"]


def job_dir(root: Path, name: str) -> Path:
    return Path(root) / "jobs" / name


def pid_alive(pid: int | None) -> bool:
    return bool(pid) and process_alive(pid)


def pids(jobdir: Path) -> list[int]:
    """The job's process and each of its instances' containers' (each leads its own process group)."""
    state = read_json(jobdir / "state.json", {})
    containers = list((state.get("container_pids") or {}).values()) or [state.get("container_pid")]
    return [p for p in (read_json(jobdir / "instance.pid.json", {}).get("pid"), *containers) if p]


def describe(root: Path, name: str) -> dict[str, Any] | None:
    """A DescribeTrainingJob response from the job's files (timestamps as epoch seconds); None
    for a job that does not exist."""
    jobdir = job_dir(root, name)
    req = read_json(jobdir / "request.json")
    if req is None:
        return None
    state = read_json(jobdir / "state.json", {})
    out = {k: v for k, v in req.items() if k not in ("Tags",)}
    transitions = [dict(t) for t in state.get("transitions", [])]
    for a, b in zip(transitions, transitions[1:]):
        a.setdefault("EndTime", b["StartTime"])
    out.update({"TrainingJobStatus": state.get("TrainingJobStatus", "InProgress"),
                "SecondaryStatus": state.get("SecondaryStatus", "Starting"),
                "SecondaryStatusTransitions": transitions,
                "LastModifiedTime": transitions[-1]["StartTime"] if transitions else req["CreationTime"],
                "ModelArtifacts": {"S3ModelArtifacts": f"{req['OutputDataConfig']['S3OutputPath'].rstrip('/')}/"
                                                       f"{name}/output/model.tar.gz"}})
    for key in ("FailureReason", "TrainingStartTime", "TrainingEndTime", "TrainingTimeInSeconds",
                "BillableTimeInSeconds"):
        if state.get(key) is not None:
            out[key] = state[key]
    return out


def summary(job: dict[str, Any]) -> dict[str, Any]:
    return {k: job[k] for k in ("TrainingJobName", "TrainingJobArn", "CreationTime", "TrainingJobStatus",
                                "SecondaryStatus") if k in job}


def visible_after(req: dict[str, Any], not_found_seconds: float, now: float | None = None) -> bool:
    """Whether the API already shows a job created at req["CreationTime"] (SageMaker's reads are
    eventually consistent: right after CreateTrainingJob, Describe may answer not found)."""
    return (now or time.time()) - req["CreationTime"] >= not_found_seconds
