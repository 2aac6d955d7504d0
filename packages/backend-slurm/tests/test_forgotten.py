"""Slurm forgets finished jobs (MinJobAge) and this cluster has no accounting (no sacct): the run
directory then has the last word, so a finished replica never reads as lost. A cluster of its own
with MinJobAge=2, so jobs leave slurmctld's memory within seconds."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from conftest import wait_for
from diloco.testing import FAIL_ON, SLEEP, launch, wait_for_output
from diloco_slurm import SlurmExecutor
from diloco_slurm.testing import SlurmCluster, job_processes


@pytest.fixture(scope="module")
def forgetful(tmp_path_factory):
    with SlurmCluster(tmp_path_factory.mktemp("slurm-forgetful"), "forgetful", min_job_age=2) as cluster:
        yield cluster


def forgotten(cluster, job_id: str) -> bool:
    answer = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=cluster.env, capture_output=True, text=True)
    return "Invalid job id" in answer.stderr


def test_finished_jobs_read_as_they_ended_after_slurm_forgot_them(forgetful, tmp_path):
    executor = SlurmExecutor(slurm_conf=str(forgetful.conf), state_dir=str(tmp_path))
    ended = launch(executor, 2, FAIL_ON, {"fail_rank": 1}, timeout=600)
    (killed,) = launch(executor, 1, SLEEP, {"seconds": 300}, timeout=600)
    assert "sleeping" in wait_for_output(executor, killed, "sleeping")
    assert wait_for(lambda: job_processes(killed.metadata["stem"]))
    for pid in job_processes(killed.metadata["stem"]):  # the replica alone: its batch shell records the end
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"diloco.bootstrap.runner" in f.read():
                os.kill(pid, signal.SIGKILL)
    handles = [*ended, killed]
    assert wait_for(lambda: all(forgotten(forgetful, h.metadata["job_id"]) for h in handles), timeout=120)

    results = executor.collect(handles, timeout=30)
    assert [(r.status.value, r.exit_code) for r in results] == [("succeeded", 0), ("failed", 1), ("failed", 137)]
    assert results[0].result["rank"] == 0  # the runner's own result file
    assert "deliberate failure on rank 1" in results[1].error
    assert "killed by SIGKILL" in results[2].error and "Slurm no longer knows the job" in results[2].error
