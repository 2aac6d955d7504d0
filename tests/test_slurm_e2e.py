"""The tiny-LM main job on a real Slurm cluster (slurmctld + slurmd started here, Debian's 22.05): four
replicas as four batch jobs meeting in a file:// store on the cluster's (here: this machine's)
filesystem. One replica's job is SIGKILLed mid-run: the Slurm backend relaunches that rank alone
as a new job, it rejoins from the store, and every replica ends holding the same global model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from conftest import events_of, one_global_model, record_of, tiny_spec, wait_for_round

pytest.importorskip("diloco_slurm")
from diloco_slurm.testing import SlurmCluster, slurm_installed  # noqa: E402


@pytest.fixture
def cluster(tmp_path):
    if not slurm_installed():
        pytest.fail("Slurm is not installed: apt-get install slurmctld slurmd slurm-client (.ci/run does it)")
    with SlurmCluster(tmp_path / "slurm", "alpha") as c:
        print(f"Slurm cluster up in {c.up_seconds:.2f}s")
        yield c


def slurm_spec(tmp_path, cluster, **kw):
    spec = tiny_spec(tmp_path, **kw)
    text = spec.read_text().replace('backend = "local"\n', "")
    text += f'\n[backend]\nname = "slurm"\nslurm_conf = "{cluster.conf}"\nstate_dir = "{tmp_path / "jobs"}"\n'
    spec.write_text(text)
    return spec


def job_pids(stem: str) -> list[int]:
    """The processes of one replica's job (the batch script's environment names its result file)."""
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if f"DILOCO_RESULT_PATH={stem}.result.json".encode() in open(f"/proc/{entry}/environ", "rb").read():
                out.append(int(entry))
        except OSError:
            pass
    return out


def cli(state, *args, timeout=600):
    return subprocess.run([sys.executable, "-m", "diloco", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "DILOCO_STATE_DIR": str(state)})


def test_tiny_lm_on_four_slurm_jobs_survives_a_killed_job_and_ends_bit_identical(tmp_path, cluster):
    state = tmp_path / "state"
    spec = slurm_spec(tmp_path, cluster, steps=120, sync_every=20, restart="backoff = 0.2\nmax_restarts_per_rank = 3")
    launcher = subprocess.Popen([sys.executable, "-m", "diloco", "run", str(spec)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env={**os.environ, "DILOCO_STATE_DIR": str(state)})
    run_id = launcher.stdout.readline().split()[1].rstrip(":")
    try:
        wait_for_round(state, run_id, 2, timeout=240)
    except AssertionError:
        launcher.send_signal(signal.SIGINT)
        raise AssertionError(launcher.communicate(timeout=120)[0][-4000:]) from None
    stem = record_of(state, run_id)["ranks"][1]["handle"]["metadata"]["stem"]
    pids = job_pids(stem)
    assert pids
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    out, _ = launcher.communicate(timeout=600)
    assert launcher.returncode == 0, out[-4000:]

    record = record_of(state, run_id)
    one_global_model(record)  # bit-identical θ on every replica
    assert [r["restarts"] for r in record["ranks"]] == [0, 1, 0, 0]
    attempts = record["ranks"][1]["attempts"]
    assert [h["metadata"]["job_name"] for h in attempts] == [f"diloco-{run_id}-r1-a0", f"diloco-{run_id}-r1-a1"]
    failed = [e for e in events_of(state, run_id) if e["event"] == "failed"]
    assert [e["rank"] for e in failed] == [1] and "killed by SIGKILL" in str(failed[0]), failed
    logs = cli(state, "logs", run_id, "--rank", "1", "--attempt", "1", "-n", "2000").stdout
    joined = [line for line in logs.splitlines() if "joined at round" in line]
    assert joined and int(joined[-1].split("joined at round ")[1].split()[0]) >= 2, logs[-2000:]
