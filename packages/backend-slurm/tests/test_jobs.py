"""What real Slurm does to a replica's job, read back through the executor: a SIGKILLed job, the time
limit, a requeue, the preemption signal, and a cancel from another shell (another executor instance)."""

from __future__ import annotations

import os
import signal
import subprocess

from conftest import wait_for
from diloco.protocol import ReplicaHandle
from diloco.testing import SLEEP, launch, wait_for_output, wait_for_status
from diloco_slurm.testing import job_processes


def scontrol(cluster, job_id: str) -> str:
    return subprocess.run(["scontrol", "show", "job", "-o", job_id], env=cluster.env, capture_output=True,
                          text=True).stdout


def job_pids(handle: ReplicaHandle) -> list[int]:
    return job_processes(handle.metadata["stem"])


def test_a_sigkilled_job_fails_137_and_its_rank_relaunches_alone(slurm, slurm_cluster):
    executor = slurm()
    handles = launch(executor, 2, SLEEP, {"seconds": 300}, timeout=600)
    assert "sleeping" in wait_for_output(executor, handles[1], "sleeping", timeout=60)
    assert wait_for(lambda: job_pids(handles[1]))
    for pid in job_pids(handles[1]):
        os.kill(pid, signal.SIGKILL)
    assert wait_for_status(executor, handles[1], {"failed"}, timeout=60) == "failed"
    (result,) = executor.collect([handles[1]], timeout=5)
    assert result.exit_code == 137 and "killed by SIGKILL" in result.error, result
    assert "Reason=JobLaunchFailure" in scontrol(slurm_cluster, handles[1].metadata["job_id"])  # the batch shell too
    assert executor.poll(handles[0]) == "running"  # the other rank goes on
    again = launch(executor, 2, SLEEP, {"seconds": 1}, run_id=handles[0].run_id, ranks=[1], attempt=1)
    assert again[0].metadata["job_name"].endswith("-r1-a1") and again[0].metadata["job_id"] != handles[1].metadata["job_id"]
    assert executor.collect(again, timeout=60)[0].status == "succeeded"
    executor.cancel(handles[0])


def test_the_time_limit_fails_the_replica_with_124(slurm, slurm_cluster):
    executor = slurm(time_limit=5)
    (handle,) = launch(executor, 1, SLEEP, {"seconds": 600}, timeout=3000)
    assert "sleeping" in wait_for_output(executor, handle, "sleeping", timeout=60)
    job_id = handle.metadata["job_id"]
    # Under two minutes left, the signal Slurm sends ahead of the limit (--signal=B:USR1@120) is
    # the warning, not a preemption: the replica carries on. Sent here by hand, as slurmctld's
    # own would arrive, once the limit is that close (its own may come too: it reads the same).
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "TimeLimit=2"], env=slurm_cluster.env, check=True)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], env=slurm_cluster.env, check=True)
    assert "not a preemption" in wait_for_output(executor, handle, "time limit is near (not a preemption)", timeout=30)
    assert "JobState=RUNNING" in scontrol(slurm_cluster, job_id)
    # The limit reached now rather than in two minutes: Slurm's own enforcement ends the job
    # (TIMEOUT, ExitCode 0:15).
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "EndTime=now"], env=slurm_cluster.env, check=True)
    (result,) = executor.collect([handle], timeout=180)
    assert "JobState=TIMEOUT" in scontrol(slurm_cluster, job_id)
    assert (result.status, result.exit_code) == ("failed", 124), result
    assert "time limit" in result.error.splitlines()[0]


def test_a_requeued_job_reads_pending_then_runs_again_under_the_same_id(slurm, slurm_cluster):
    executor = slurm()
    (handle,) = launch(executor, 1, SLEEP, {"seconds": 300}, timeout=600)
    job_id = handle.metadata["job_id"]
    # requeued once the replica runs (a requeue while slurmd still launches the batch step is another case)
    assert "sleeping" in wait_for_output(executor, handle, "sleeping", timeout=60)
    assert executor.reruns(handle) == 0
    subprocess.run(["scontrol", "requeue", job_id], env=slurm_cluster.env, check=True)
    assert wait_for_status(executor, handle, {"pending"}, timeout=30) == "pending"
    detail = executor.status_detail(handle)
    assert detail and "requeued (restart 1)" in detail, detail
    assert executor.reruns(handle) == 1  # the launcher marks run 0 away; the next run is DILOCO_RERUN=1
    wait_for(lambda: "JobState=PENDING" in scontrol(slurm_cluster, job_id), timeout=30)
    # the hold keeps the job off the node until its first run has ended there; released early, it
    # may only start once that run's processes are gone (else slurmd refuses the second launch)
    assert wait_for(lambda: not job_pids(handle), timeout=60)
    slurm_cluster.release(job_id)  # the ~120 s BeginTime hold Slurm puts on a requeued job
    again = wait_for_status(executor, handle, {"running"}, timeout=60)
    assert again == "running", (again, scontrol(slurm_cluster, job_id), executor.stream_logs(handle))
    assert "restart 1" in wait_for_output(executor, handle, "(restart 1)", timeout=30)
    assert "(attempt 0 rerun 1)" in wait_for_output(executor, handle, "(attempt 0 rerun 1)", timeout=30)  # its run
    executor.cancel(handle)
    assert wait_for_status(executor, handle, {"cancelled"}) == "cancelled"


def test_the_preemption_signal_ends_the_replica_as_preempted(slurm, slurm_cluster):
    executor = slurm()
    (handle,) = launch(executor, 1, SLEEP, {"seconds": 300}, timeout=600)
    assert "sleeping" in wait_for_output(executor, handle, "sleeping", timeout=60)
    assert wait_for(lambda: job_pids(handle))
    # what a site's preemption sends with PreemptParameters=send_user_signal: the job's --signal, to the batch shell
    subprocess.run(["scancel", "--batch", "--signal=USR1", handle.metadata["job_id"]], env=slurm_cluster.env, check=True)
    (result,) = executor.collect([handle], timeout=60)
    assert (result.status, result.exit_code) == ("failed", 75), result
    assert "a preemption" in executor.stream_logs(handle)


def test_cancel_from_another_shell_leaves_no_job(slurm, slurm_cluster):
    first = slurm()
    handles = launch(first, 2, SLEEP, {"seconds": 300}, timeout=600)
    assert wait_for_status(first, handles[0], {"running"}) == "running"
    other = slurm()  # another process, holding only the handles' JSON
    for text in [h.to_json() for h in handles]:
        other.cancel(ReplicaHandle.from_json(text))
    for h in handles:
        assert wait_for_status(first, h, {"cancelled"}) == "cancelled"
        assert wait_for(lambda h=h: "JobState=CANCELLED" in scontrol(slurm_cluster, h.metadata["job_id"]))
    assert wait_for(lambda: not any(job_pids(h) for h in handles), timeout=30)
    squeue = subprocess.run(["squeue", "-h", "-t", "PD,R,CG", "-o", "%i"], env=slurm_cluster.env,
                            capture_output=True, text=True).stdout.split()
    assert not {h.metadata["job_id"] for h in handles} & set(squeue)


def test_a_job_cancelled_outside_diloco_is_named_so(slurm, slurm_cluster):
    executor = slurm()
    (handle,) = launch(executor, 1, SLEEP, {"seconds": 300}, timeout=600)
    assert wait_for_status(executor, handle, {"running"}) == "running"
    subprocess.run(["scancel", handle.metadata["job_id"]], env=slurm_cluster.env, check=True)
    (result,) = executor.collect([handle], timeout=60)
    assert result.status == "cancelled" and "cancelled outside diloco" in result.error, result


def test_diloco_cancel_from_another_shell_stops_the_run_and_leaves_no_job(slurm_cluster, tmp_path):
    import json
    import sys

    spec = tmp_path / "diloco.toml"
    spec.write_text(f'entrypoint = "diloco.testing.entrypoints:sleep"\nreplicas = 2\ntimeout = 600\n[args]\n'
                    f'seconds = 300\n[backend]\nname = "slurm"\nslurm_conf = "{slurm_cluster.conf}"\n'
                    f'state_dir = "{tmp_path / "jobs"}"\n')
    env = {**os.environ, "DILOCO_STATE_DIR": str(tmp_path / "state"), "DILOCO_PLUGINS": "diloco_slurm.plugin"}

    def diloco(*args):
        return subprocess.run([sys.executable, "-m", "diloco", *args], capture_output=True, text=True, env=env,
                              timeout=120)

    launcher = subprocess.Popen([sys.executable, "-m", "diloco", "run", str(spec)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env)
    try:
        run_id = launcher.stdout.readline().split()[1].rstrip(":")
        live = lambda: json.loads(diloco("status", run_id, "--json").stdout or "{}").get("live") or {}  # noqa: E731
        assert wait_for(lambda: set(live().values()) == {"running"} and len(live()) == 2, timeout=90), live()
        handles = [r["handle"] for r in json.loads(diloco("status", run_id, "--json").stdout)["record"]["ranks"]]
        cancelled = diloco("cancel", run_id)
        assert cancelled.returncode == 0, cancelled.stderr
        launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert set(live().values()) == {"cancelled"}, live()
    ids = {h["metadata"]["job_id"] for h in handles}
    for job_id in ids:
        assert wait_for(lambda j=job_id: "JobState=CANCELLED" in scontrol(slurm_cluster, j))
    assert wait_for(lambda: not any(job_processes(h["metadata"]["stem"]) for h in handles), timeout=30)
    squeue = subprocess.run(["squeue", "-h", "-o", "%i"], env=slurm_cluster.env, capture_output=True, text=True)
    assert not ids & set(squeue.stdout.split())
