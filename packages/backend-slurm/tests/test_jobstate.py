"""The mapping from what Slurm and the run directory say to the replica's status: pure, table-tested."""

from __future__ import annotations

import pytest

from diloco_slurm.jobstate import JobFacts, SlurmView, decide, parse_sacct, parse_scontrol, slurm_exit_code

OK = {"status": "succeeded", "exit_code": 0, "error": None}
RAISED = {"status": "failed", "exit_code": 1, "error": "RuntimeError: boom"}
PREEMPTED = {"status": "failed", "exit_code": 75, "error": "preempted"}


def view(state, reason="None", exit_code="0:0", restarts=0, by=None):
    return SlurmView(state, reason, exit_code, restarts, by)


@pytest.mark.parametrize("slurm, result, exit_file, ours, status, code, words", [
    # Slurm knows the job
    (view("PENDING", "Priority"), None, None, False, "pending", None, None),
    (view("PENDING", "BeginTime", restarts=1), RAISED, 143, False, "pending", None, None),  # a requeue's stale files
    (view("REQUEUE_HOLD"), None, None, False, "pending", None, None),
    (view("SUSPENDED"), None, None, False, "pending", None, None),
    (view("RUNNING"), None, None, False, "running", None, None),
    (view("RUNNING"), None, None, True, "cancelled", None, "cancelled"),
    (view("COMPLETING"), None, None, False, "running", None, None),
    (view("COMPLETING"), OK, None, False, "succeeded", 0, None),
    (view("COMPLETED"), OK, 0, False, "succeeded", 0, None),
    (view("COMPLETED"), None, None, False, "succeeded", 0, None),
    (view("FAILED", "NonZeroExitCode", "1:0"), RAISED, 1, False, "failed", 1, None),
    (view("FAILED", "NonZeroExitCode", "75:0"), PREEMPTED, 75, False, "failed", 75, None),
    (view("FAILED", "NonZeroExitCode", "3:0"), None, None, False, "failed", 3, "exited with code 3"),
    (view("FAILED", "JobLaunchFailure", "0:9"), None, None, False, "failed", 137, "killed by SIGKILL"),
    (view("TIMEOUT", exit_code="0:15"), None, 143, False, "failed", 124, "time limit"),
    (view("DEADLINE"), None, None, False, "failed", 124, "deadline"),
    (view("PREEMPTED", exit_code="0:15"), None, None, False, "failed", 75, "preempted"),
    (view("NODE_FAIL"), None, None, False, "failed", 137, "NODE_FAIL"),
    (view("OUT_OF_MEMORY", exit_code="0:125"), None, None, False, "failed", 137, "OUT_OF_MEMORY"),
    (view("BOOT_FAIL"), None, None, False, "failed", 1, "BOOT_FAIL"),
    (view("CANCELLED", exit_code="0:15"), None, 143, True, "cancelled", None, "cancelled"),
    (view("CANCELLED", exit_code="0:15"), None, None, False, "cancelled", None, "cancelled outside diloco"),
    (view("CANCELLED", by="1000"), None, None, False, "cancelled", None, "by uid 1000"),
    # Slurm forgot the job (MinJobAge, no accounting): the run directory has the last word
    (None, OK, 0, False, "succeeded", 0, None),
    (None, RAISED, 1, False, "failed", 1, None),
    (None, None, 0, False, "succeeded", 0, None),
    (None, None, 143, False, "failed", 143, "killed by SIGTERM"),
    (None, None, 143, True, "cancelled", None, "cancelled"),
    (None, None, None, False, "failed", None, "is lost"),
])
def test_decide(slurm, result, exit_file, ours, status, code, words):
    verdict = decide(JobFacts("42", slurm, result, exit_file, ours))
    assert verdict.status == status
    if status in ("failed", "succeeded"):
        assert verdict.exit_code == code
    assert (verdict.cause is None) if words is None else words in verdict.cause


def test_pending_says_why_and_names_a_requeue():
    detail = decide(JobFacts("7", view("PENDING", "BeginTime", restarts=2))).detail
    assert "requeued (restart 2)" in detail and "BeginTime" in detail and "120 s" in detail
    assert decide(JobFacts("7", view("PENDING", "Resources"))).detail == "Slurm job 7 is pending: Slurm's reason: Resources"


def test_parse_what_slurm_22_05_prints():
    line = ("JobId=2 JobName=diloco-x-r0-a0 UserId=root(0) JobState=FAILED Reason=JobLaunchFailure Dependency=(null) "
            "Requeue=1 Restarts=1 BatchFlag=1 ExitCode=0:9 WorkDir=/tmp/a b StdOut=/tmp/x.log")
    assert parse_scontrol(line) == SlurmView("FAILED", "JobLaunchFailure", "0:9", 1)
    assert parse_scontrol("slurm_load_jobs error: Invalid job id specified") is None
    assert parse_sacct("CANCELLED by 1000|0:15|None\n") == SlurmView("CANCELLED", "None", "0:15", 0, "1000")
    assert parse_sacct("TIMEOUT|0:15|None") == SlurmView("TIMEOUT", "None", "0:15", 0)
    assert parse_sacct("") is None


@pytest.mark.parametrize("text, code", [("0:0", 0), ("3:0", 3), ("0:9", 137), ("0:15", 143), ("garbage", 0)])
def test_slurm_exit_codes(text, code):
    assert slurm_exit_code(text) == code
