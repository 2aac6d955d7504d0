"""Runs on the real Slurm (`diloco run`, the launcher supervising Slurm jobs) through what ends a
replica's job without a failure of its own: the jobs' time limit (Slurm's TIMEOUT, exit 124), a
`scancel` by someone else, and a partition's MaxTime at plan time."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import wait_for

HOLD = '''
import os, time
from pathlib import Path

def main(ctx, marker_dir: str, hold: list = (), until: str = ""):
    """Marks its start; an attempt named in `hold` ("rank.attempt") sleeps until Slurm or someone
    stops it; every attempt then waits (at most 5 minutes) until the marker `until` exists."""
    Path(marker_dir, f"{ctx.rank}.{ctx.attempt}").touch()
    print(f"rank {ctx.rank} attempt {ctx.attempt} started", flush=True)
    if f"{ctx.rank}.{ctx.attempt}" in hold:
        time.sleep(600)
    deadline = time.monotonic() + 300
    while until and not Path(marker_dir, until).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return {"rank": ctx.rank, "attempt": ctx.attempt}
'''


def project(tmp_path, cluster, args: str, backend: str = "", restart: str = ""):
    """A spec of 2 replicas as Slurm jobs on the test cluster, and where its attempts leave markers."""
    (tmp_path / "hold.py").write_text(HOLD)
    markers = tmp_path / "markers"
    markers.mkdir(exist_ok=True)
    spec = tmp_path / "diloco.toml"
    spec.write_text(f'entrypoint = "hold:main"\nreplicas = 2\n[args]\nmarker_dir = "{markers}"\n{args}\n'
                    f'[restart]\nmonitor_interval = 0.2\nbackoff = 0.1\n{restart}\n'
                    f'[backend]\nname = "slurm"\nslurm_conf = "{cluster.conf}"\nstate_dir = "{tmp_path / "jobs"}"\n'
                    f'{backend}\n')
    return spec, markers


def env(tmp_path):
    return {**os.environ, "DILOCO_STATE_DIR": str(tmp_path / "state"), "DILOCO_PLUGINS": "diloco_slurm.plugin"}


def diloco(tmp_path, *args, timeout=120):
    return subprocess.run([sys.executable, "-m", "diloco", *args], capture_output=True, text=True, env=env(tmp_path),
                          timeout=timeout)


def launch(tmp_path, spec):
    launcher = subprocess.Popen([sys.executable, "-m", "diloco", "run", str(spec)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env(tmp_path))
    return launcher, launcher.stdout.readline().split()[1].rstrip(":")


def finish(launcher, timeout):
    try:
        out, _ = launcher.communicate(timeout=timeout)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    return out


def status(tmp_path, run_id):
    return json.loads(diloco(tmp_path, "status", run_id, "--json").stdout)


def test_a_job_at_its_one_minute_slurm_time_limit_is_relaunched_without_spending_restarts(slurm_cluster, tmp_path):
    """`time_limit = 1` (Slurm's granularity is minutes): rank 1's first job runs into it (TIMEOUT,
    exit 124, ended by slurmctld within ~1.5 minutes), is relaunched as a new job with no restart to
    spend, and the run ends succeeded. Rank 0 waits for rank 1's return inside its own minute."""
    spec, markers = project(tmp_path, slurm_cluster, 'hold = ["1.0"]', backend="time_limit = 1",
                            restart="max_restarts = 0\nmax_restarts_per_rank = 0")
    launcher, run_id = launch(tmp_path, spec)
    out = finish(launcher, timeout=300)
    assert launcher.returncode == 0, out
    data = status(tmp_path, run_id)
    ranks = data["record"]["ranks"]
    assert [(r["restarts"], r["time_limits"]) for r in ranks] == [(0, 0), (0, 1)], ranks
    assert ranks[1]["result"] == {"rank": 1, "attempt": 1}
    (timed,) = [e for e in data["events"] if e["event"] == "time_limit"]
    assert timed["rank"] == 1 and "reached its Slurm time limit (TIMEOUT" in timed["error"], timed
    assert not [e for e in data["events"] if e["event"] in ("failed", "give_up", "run_cancelled")]


def test_a_job_scancelled_outside_diloco_is_relaunched_and_the_other_is_untouched(slurm_cluster, tmp_path):
    """The issue's case: `scancel` of rank 1's job (an admin, a user freeing a GPU) is that rank's
    loss: relaunched within its restart budget, rank 0's job runs on untouched, the run succeeds."""
    spec, markers = project(tmp_path, slurm_cluster, 'hold = ["1.0"]\nuntil = "1.1"')
    launcher, run_id = launch(tmp_path, spec)
    try:
        assert wait_for(lambda: (markers / "0.0").exists() and (markers / "1.0").exists(), timeout=90)
        jobs = [r["handle"]["metadata"]["job_id"] for r in status(tmp_path, run_id)["record"]["ranks"]]
        subprocess.run(["scancel", jobs[1]], env=slurm_cluster.env, check=True)
    finally:
        out = finish(launcher, timeout=180)
    assert launcher.returncode == 0, out
    data = status(tmp_path, run_id)
    ranks = data["record"]["ranks"]
    assert [r["status"] for r in ranks] == ["succeeded"] * 2 and [len(r["attempts"]) for r in ranks] == [1, 2]
    assert ranks[0]["handle"]["metadata"]["job_id"] == jobs[0] and [r["restarts"] for r in ranks] == [0, 1]
    (cancelled,) = [e for e in data["events"] if e["event"] == "cancelled_outside"]
    assert cancelled["rank"] == 1 and "was cancelled outside diloco" in cancelled["error"], cancelled
    assert not [e for e in data["events"] if e["event"] in ("run_cancelled", "cancelled")]


def test_a_plan_stays_inside_the_partitions_max_time(slurm_cluster, tmp_path):
    """Partition `short` has MaxTime 2 minutes: the time limit derived from the spec's timeout is
    clamped to it, and the dry run says so; one asked for over it is refused in one line."""
    spec, _ = project(tmp_path, slurm_cluster, "", backend='partition = "short"')
    dry = diloco(tmp_path, "dryrun", str(spec))
    assert dry.returncode == 0, dry.stderr
    plan = json.loads(dry.stdout[dry.stdout.index("{"):])
    assert plan["time_limit"]["minutes"] == 2 and "clamped to 2 minutes" in plan["time_limit"]["note"]
    assert "#SBATCH --time=2" in plan["jobs"][0]["script"]
    spec.write_text(spec.read_text() + "time_limit = 5\n")
    refused = diloco(tmp_path, "dryrun", str(spec))
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines() == [refused.stderr.strip()]
    assert "over the MaxTime of partition 'short' (2 minutes)" in refused.stderr
