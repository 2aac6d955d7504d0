"""The tiny-LM main job on a real Slurm cluster (slurmctld + slurmd started here, Debian's 22.05): four
replicas as four batch jobs meeting in a file:// store on the cluster's (here: this machine's)
filesystem. Mid-run, one job is SIGKILLed (relaunched alone as a new job, one restart spent), one
gets the preemption signal (exits 75, relaunched without spending the budget) and one is requeued
by Slurm (pending, then runs again under its job id: nothing relaunched, nothing spent); each
rejoins from the store and every replica ends holding the same global model. Then one run over
two Slurm clusters, one reached through a real sshd, and a local group, on one moto S3 store. And a
replica of two nodes (one job of two nodes, on a cluster of two slurmd on this machine) that loses
a node mid-run, is relaunched once as a whole and rejoins bit-identical."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, events_of, on_s3, one_global_model, placed_by_groups, record_of, tiny_spec
from test_gone import round_ends

pytest.importorskip("diloco_slurm")
from diloco_slurm.testing import SlurmCluster, job_processes, node_agent, slurm_installed  # noqa: E402


@pytest.fixture
def cluster(tmp_path):
    if not slurm_installed():
        pytest.fail("Slurm is not installed: apt-get install slurmctld slurmd slurm-client (.ci/run does it)")
    with SlurmCluster(tmp_path / "slurm", "alpha") as c:
        print(f"Slurm cluster up in {c.up_seconds:.2f}s, first job running after {c.first_job_seconds:.2f}s more")
        yield c


def slurm_spec(tmp_path, cluster, **kw):
    spec = tiny_spec(tmp_path, **kw)
    text = spec.read_text().replace('backend = "local"\n', "")
    text += f'\n[backend]\nname = "slurm"\nslurm_conf = "{cluster.conf}"\nstate_dir = "{tmp_path / "jobs"}"\n'
    spec.write_text(text)
    return spec


ROUND_TIMEOUT = 120  # the tiny spec's: a round that waited for the requeued reducer took this long


def cli(state, *args, timeout=600):
    return subprocess.run([sys.executable, "-m", "diloco", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "DILOCO_STATE_DIR": str(state)})


def reducing(phases, rank: int, after_round: int, launcher, timeout: float = 240) -> int:
    """Wait until `rank` starts reducing its shards of a round after `after_round` (the replica's
    own phase marker, DILOCO_FAULT_PHASE_FILE); that round."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and launcher.poll() is None:
        try:
            phase, r, _ = (phases / f"phase-{rank}").read_text().split()
        except (FileNotFoundError, ValueError):  # not yet written, or caught mid-write
            phase, r = "", "0"
        if phase == "reduce" and int(r) > after_round:
            return int(r)
        time.sleep(0.01)
    launcher.send_signal(signal.SIGINT)
    raise AssertionError(launcher.communicate(timeout=120)[0][-4000:])


def disturb_three_ranks(state, run_id, cluster, launcher, phases) -> tuple[list[dict], int, float]:
    """While rank 3 reduces its shards of a round after round 2: requeue its job, SIGKILL rank 1's,
    send rank 2's the preemption signal. The four jobs' handles as they were, that round, and when."""
    r = reducing(phases, 3, 2, launcher)
    disturbed = time.time()
    jobs = [r["handle"]["metadata"] for r in record_of(state, run_id)["ranks"]]
    slurm = {"env": cluster.env, "check": True, "capture_output": True, "text": True}
    subprocess.run(["scontrol", "requeue", jobs[3]["job_id"]], **slurm)  # rank 3: requeued by Slurm
    pids = job_processes(jobs[1]["stem"])  # rank 1: the replica and its batch shell, the job SIGKILLed
    assert pids
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    subprocess.run(["scancel", "--batch", "--signal=USR1", jobs[2]["job_id"]], **slurm)  # rank 2: preempted
    deadline = time.monotonic() + 60  # held until the launcher has seen it pending (a requeue is no failure)
    while not any(e["event"] == "pending" and e.get("rank") == 3 for e in events_of(state, run_id)):
        assert time.monotonic() < deadline and launcher.poll() is None, events_of(state, run_id)[-5:]
        time.sleep(0.1)
    cluster.release(jobs[3]["job_id"])  # end the ~120 s hold a requeue puts on a job
    return jobs, r, disturbed


def test_tiny_lm_on_four_slurm_jobs_survives_a_kill_a_preemption_and_a_requeue_bit_identical(tmp_path, cluster):
    """No round waits for what the three disturbances took, the requeued reducer included (Slurm
    numbers a job's runs, so the launcher marks the run it requeued away: its shards are taken over
    at once, where they once waited out the whole round_timeout)."""
    state, phases = tmp_path / "state", tmp_path / "phases"
    phases.mkdir()
    # 15 rounds, each phase of each stretched by 0.3 s: rank 3 is requeued while it reduces, and the
    # three new runs (processes importing torch, slow on a loaded machine) still meet a running run
    marker = f'\n[env]\nDILOCO_FAULT_PHASE_FILE = "{phases}/phase-{{rank}}"\nDILOCO_FAULT_PHASE_DELAY = "0.3"\n'
    spec = slurm_spec(tmp_path, cluster, steps=300, sync_every=20, restart="backoff = 0.2\nmax_restarts_per_rank = 3",
                      extra=marker)
    launcher = subprocess.Popen([sys.executable, "-m", "diloco", "run", str(spec)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env={**os.environ, "DILOCO_STATE_DIR": str(state)})
    try:
        run_id = launcher.stdout.readline().split()[1].rstrip(":")
        jobs, requeued_in, disturbed = disturb_three_ranks(state, run_id, cluster, launcher, phases)
        out, _ = launcher.communicate(timeout=600)
    finally:
        if launcher.poll() is None:  # a failed check must not leave the launcher behind
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 0, out[-4000:]

    record = record_of(state, run_id)
    one_global_model(record)  # bit-identical θ on every replica
    ranks = record["ranks"]
    assert [r["restarts"] for r in ranks] == [0, 1, 0, 0] and [r["preemptions"] for r in ranks] == [0, 0, 1, 0], \
        [e for e in events_of(state, run_id) if e["event"] != "round"]
    assert [h["metadata"]["job_name"] for h in ranks[1]["attempts"]] == [f"diloco-{run_id}-r1-a0",
                                                                         f"diloco-{run_id}-r1-a1"]
    assert [h["metadata"]["job_id"] for h in ranks[3]["attempts"]] == [jobs[3]["job_id"]]  # requeued, not relaunched
    events = events_of(state, run_id)
    failed = [e for e in events if e["event"] == "failed"]
    assert [e["rank"] for e in failed] == [1] and "killed by SIGKILL" in str(failed[0]), failed
    assert [e["rank"] for e in events if e["event"] == "preempted"] == [2]
    pending = [e for e in events if e["event"] == "pending" and e["rank"] == 3]
    assert pending and "requeued" in str(pending[0]), [e for e in events if e.get("rank") == 3]
    assert pending[0].get("rerun") == 1, pending
    for rank, attempt in ((1, 1), (2, 1), (3, 0)):
        logs = cli(state, "logs", run_id, "--rank", str(rank), "--attempt", str(attempt), "-n", "3000").stdout
        joined = [line for line in logs.splitlines() if "joined at round" in line]
        assert joined and int(joined[-1].split("joined at round ")[1].split()[0]) >= 2, (rank, logs[-2000:])
        assert (f"attempt 0 rerun 1] " in joined[-1]) is (rank == 3), joined[-1]  # the requeued job's next run
    ends = round_ends(state, run_id)
    assert {r for _, r, _ in ends} == set(range(1, 16)), ends
    periods = [(r, round(b - a, 1)) for (a, _, _), (b, r, _) in zip(ends, ends[1:]) if b > disturbed]
    assert max(p for _, p in periods) < ROUND_TIMEOUT / 2, (requeued_in, periods)


@pytest.fixture
def two_clusters(tmp_path, cluster):
    """A second cluster beside `cluster` (its own ports and SLURM_CONF), reached through a real sshd."""
    from diloco_slurm.testing import LoopbackSshd, sshd_installed

    if not sshd_installed():
        pytest.fail("OpenSSH is not installed: apt-get install openssh-server (.ci/run does it)")
    with SlurmCluster(tmp_path / "slurm-beta", "beta") as beta, LoopbackSshd(tmp_path / "sshd") as sshd:
        yield cluster, beta, sshd


def test_one_run_over_two_slurm_clusters_one_through_ssh_and_a_local_group_on_one_s3_store(tmp_path, s3,
                                                                                          two_clusters):
    import shlex

    from diloco_slurm.testing import ALIAS

    alpha, beta, sshd = two_clusters
    state = tmp_path / "state"
    spec = on_s3(tiny_spec(tmp_path, steps=60, sync_every=20), s3)
    setup = [f"export PYTHONPATH={shlex.quote(os.environ['PYTHONPATH'])}"] if os.environ.get("PYTHONPATH") else []
    text = placed_by_groups(spec) + f"""
[[group]]
name = "here"
replicas = 1
[group.backend]
name = "local"

[[group]]
name = "alpha"
replicas = 2
[group.backend]
name = "slurm"
slurm_conf = "{alpha.conf}"
state_dir = "{tmp_path / 'alpha-jobs'}"

[[group]]
name = "beta"
replicas = 1
[group.backend]
name = "slurm"
host = "{ALIAS}"
ssh_config = "{sshd.ssh_config}"
slurm_conf = "{beta.conf}"
state_dir = "{tmp_path / 'beta-jobs'}"
python = "{sys.executable}"
workdir = "{ROOT / 'examples' / 'tiny-lm'}"
setup = {json.dumps(setup)}
"""
    spec.write_text(text)
    dry = cli(state, "dryrun", str(spec))
    assert dry.returncode == 0, dry.stderr
    assert "# group alpha: 2 × slurm, ranks 1-2" in dry.stdout and "# group beta: 1 × slurm, rank 3" in dry.stdout
    assert "BatchMode=yes" in dry.stdout and s3["env"]["AWS_SECRET_ACCESS_KEY"] not in dry.stdout

    proc = cli(state, "run", str(spec), timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    run_id = proc.stdout.split()[1].rstrip(":")
    record = record_of(state, run_id)
    one_global_model(record)
    assert [r["group"] for r in record["ranks"]] == ["here", "alpha", "alpha", "beta"]
    assert record["ranks"][3]["handle"]["metadata"]["cluster"] == f"{ALIAS} (over ssh)"
    keys = [o["Key"] for o in s3["client"].list_objects_v2(Bucket=s3["bucket"], Prefix=f"runs/{run_id}/")["Contents"]]
    assert any("/reduced/" in k for k in keys)  # they met in S3
    logs = cli(state, "logs", run_id, "--rank", "3").stdout
    assert "round 3: loss" in logs, logs[-2000:]


@pytest.fixture
def two_node_cluster(tmp_path):
    """A cluster of two nodes: two slurmd on this machine (Slurm's multiple-slurmd mode)."""
    if not slurm_installed():
        pytest.fail("Slurm is not installed: apt-get install slurmctld slurmd slurm-client (.ci/run does it)")
    with SlurmCluster(tmp_path / "slurm", "pair", nodes=2, cpus=4, memory_mb=4096) as c:
        yield c


def in_round(marker, after_round: int, launcher, timeout: float = 240) -> int:
    """Wait until the process whose phase marker is `marker` is in a round after `after_round`; that round
    (the launcher stopped, its output raised, if it never is)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and launcher.poll() is None:
        try:
            _phase, r, _ = marker.read_text().split()
        except (FileNotFoundError, ValueError):  # not yet written, or caught mid-write
            r = "0"
        if int(r) > after_round:
            return int(r)
        time.sleep(0.02)
    launcher.send_signal(signal.SIGINT)
    raise AssertionError(launcher.communicate(timeout=120)[0][-4000:])


def test_a_replica_of_two_slurm_nodes_loses_a_node_is_relaunched_once_and_rejoins_bit_identical(tmp_path,
                                                                                               two_node_cluster):
    """Rank 1 is one job of two nodes (a torchrun agent on each, one process per node, DDP across
    them), rank 0 a job of one. Mid-run node 1's agent is SIGKILLed: Slurm ends the job (node 0
    stopped by srun --kill-on-bad-exit), the replica fails once, naming the node, and is relaunched
    as one new two-node job, rejoins, trains beside rank 0 again, and every replica ends on the same
    θ. Rank 0 is held still (SIGSTOP) from the kill until rank 1 has rejoined, so the rejoin lands
    mid-run at any machine's pace: a relaunch is a job and torch imported on two nodes, seconds
    against rounds of a fraction of one."""
    state, phases = tmp_path / "state", tmp_path / "phases"
    phases.mkdir()
    marker = (f'\n[env]\nDILOCO_FAULT_PHASE_FILE = "{phases}/phase-{{rank}}-{{lane}}"\n'
              f'DILOCO_FAULT_PHASE_DELAY = "0.2"\n')
    spec = tiny_spec(tmp_path, steps=80, sync_every=20, restart="backoff = 0.2", extra=marker)
    backend = (f'[group.backend]\nname = "slurm"\nslurm_conf = "{two_node_cluster.conf}"\n'
               f'state_dir = "{tmp_path / "jobs"}"\n')
    spec.write_text(placed_by_groups(spec) + f'\n[[group]]\nname = "single"\nreplicas = 1\n{backend}'
                                           f'\n[[group]]\nname = "island"\nreplicas = 1\nnodes = 2\n{backend}')
    launcher = subprocess.Popen([sys.executable, "-m", "diloco", "run", str(spec)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env={**os.environ, "DILOCO_STATE_DIR": str(state)})
    held: list[int] = []
    try:
        run_id = launcher.stdout.readline().split()[1].rstrip(":")
        in_round(phases / "phase-1-1", 1, launcher)  # node 1's process, in round 2 or later
        stems = [r["handle"]["metadata"]["stem"] for r in record_of(state, run_id)["ranks"]]
        agent = node_agent(stems[1], 1)
        assert agent and node_agent(stems[1], 0), stems
        held = job_processes(stems[0])
        for pid in held:
            os.kill(pid, signal.SIGSTOP)
        os.kill(agent, signal.SIGKILL)
        again = Path(stems[1].replace(".attempt-0", ".attempt-1") + ".log")  # the relaunched job's output
        deadline = time.monotonic() + 240
        while (again.read_text() if again.exists() else "").count("joined at round") < 2:  # both nodes' processes
            assert time.monotonic() < deadline and launcher.poll() is None, events_of(state, run_id)[-5:]
            time.sleep(0.1)
        for pid in held:
            os.kill(pid, signal.SIGCONT)
        out, _ = launcher.communicate(timeout=600)
    finally:
        for pid in held:  # a failed check must leave nothing stopped, nor the launcher behind
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 0, out[-4000:]
    record = record_of(state, run_id)
    one_global_model(record)  # bit-identical θ on every replica: node 0's result is the replica's
    assert [r["restarts"] for r in record["ranks"]] == [0, 1] and record["restarts_used"] == 1, out[-3000:]
    events = events_of(state, run_id)
    assert [(e["event"], e.get("rank")) for e in events if e["event"] in ("failed", "relaunch_scheduled")] == [
        ("failed", 1), ("relaunch_scheduled", 1)]  # one node lost: one failure seen, one relaunch
    failed = next(e for e in events if e["event"] == "failed")
    assert "node 1 of 2 killed by SIGKILL" in str(failed), failed
    attempts = record["ranks"][1]["attempts"]
    assert [h["metadata"]["job_name"] for h in attempts] == [f"diloco-{run_id}-r1-a0", f"diloco-{run_id}-r1-a1"]
    assert node_agent(stems[1], 0) is None and not job_processes(stems[1])  # node 0 was stopped with node 1
    first = Path(stems[1] + ".log").read_text()
    assert "diloco: 2 nodes (n[1-2]); node 0 (n1) holds the replica's store at 127.0.0.1:" in first, first[-2000:]
    assert "srun: error: n2: task 1: Exited with exit code 137" in first, first[-2000:]
    joined = {int(x.split("joined at round ")[1].split()[0]) for x in again.read_text().splitlines()
              if "joined at round" in x}
    assert len(joined) == 1, again.read_text()[-2000:]  # both nodes' processes at one round, as one replica
    seen = [e["members"] for e in events if e["event"] == "round"]
    alone = seen.index([0])  # rank 0 trained on without it, then rank 1 rejoined rank 0 in a round
    assert [0, 1] in seen[alone:] and not [e for e in events if e["event"] == "diverged"], seen
