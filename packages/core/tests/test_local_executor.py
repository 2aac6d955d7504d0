"""LocalProcessExecutor against real subprocesses: the conformance kit plus local specifics."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diloco.local.executor import LocalProcessExecutor
from diloco.protocol import ReplicaHandle
from diloco.testing import ExecutorConformance, launch, process_alive

from conftest import write_spec


class TestLocalConformance(ExecutorConformance):
    def make_executor(self):
        return LocalProcessExecutor(grace_period=2.0)



def _wait(predicate, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_four_replica_run_succeeds(cli, project):
    spec = write_spec(project, 'backend = "local"\nreplicas = 4\nentrypoint = "job:main"\n'
                               '[restart]\nmonitor_interval = 0.1\n')
    proc = cli("run", str(spec), check_rc=0)
    assert "SUCCEEDED" in proc.stdout
    run_id = proc.stdout.split()[1].rstrip(":")
    status = json.loads(cli("status", run_id, "--json", check_rc=0).stdout)
    assert status["record"]["state"] == "SUCCEEDED"
    assert status["live"] == {str(r): "succeeded" for r in range(4)} or \
        status["live"] == {r: "succeeded" for r in range(4)}


def test_failing_rank_reported_with_traceback(cli, project):
    spec = write_spec(project, 'backend = "local"\nreplicas = 4\nentrypoint = "job:main"\n'
                               '[args]\nfail_rank = 2\n[restart]\npolicy = "never"\nmonitor_interval = 0.1\n')
    proc = cli("run", str(spec))
    assert proc.returncode == 1
    assert "rank 2: ValueError: exploded on rank 2" in proc.stdout
    run_id = proc.stdout.split()[1].rstrip(":")
    record = json.loads(cli("status", run_id, "--json").stdout)["record"]
    err = record["ranks"][2]["last_error"]
    assert err.startswith("ValueError: exploded on rank 2\nTraceback (most recent call last)") and 'job.py", line 7, in main' in err
    statuses = [r["status"] for r in record["ranks"]]
    # the others end as they were when rank 2's failure ended the run: done, or stopped by it (a loaded host)
    assert statuses[2] == "failed" and all(s in ("succeeded", "cancelled_by_supervisor") for i, s in
                                           enumerate(statuses) if i != 2), statuses


def test_logs_from_a_second_process(cli, project):
    spec = write_spec(project, 'backend = "local"\nreplicas = 4\nentrypoint = "job:main"\n'
                               '[restart]\nmonitor_interval = 0.1\n')
    run_id = cli("run", str(spec), check_rc=0).stdout.split()[1].rstrip(":")
    out = cli("logs", run_id, "--rank", "2", check_rc=0).stdout
    assert out.splitlines() == [f"rank 2/4 step {i}" for i in range(3)]
    everything = cli("logs", run_id, check_rc=0).stdout
    assert "==> rank 0 attempt 0 <==" in everything and "rank 3/4 step 2" in everything
    bad = cli("logs", run_id, "--rank", "9")
    assert bad.returncode == 2 and "has no rank 9" in bad.stderr


def test_cancel_from_second_process_kills_whole_tree(cli, project, state_dir):
    """The replicas spawn grandchildren; after `diloco cancel` none of them may be alive."""
    (project / "spawner.py").write_text(
        "import os, subprocess, sys, time\n"
        "def main(ctx, pid_dir: str = ''):\n"
        "    child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "    path = os.path.join(pid_dir, f'{ctx.rank}.pids')\n"
        "    with open(path + '.tmp', 'w') as f:\n"
        "        f.write(f'{os.getpid()} {child.pid}')\n"
        "    os.replace(path + '.tmp', path)  # whole when it appears: the test reads it at once\n"
        "    time.sleep(600)\n")
    pid_dir = project / "pids"
    pid_dir.mkdir()
    spec = write_spec(project, f'backend = "local"\nreplicas = 3\nentrypoint = "spawner:main"\n'
                               f'[args]\npid_dir = "{pid_dir}"\n[restart]\nmonitor_interval = 0.1\n')
    launcher = subprocess.Popen([sys.executable, "-m", "diloco", "run", str(spec), "--on-interrupt", "detach"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "DILOCO_STATE_DIR": str(state_dir)})
    try:
        run_id = launcher.stdout.readline().split()[1].rstrip(":")
        assert _wait(lambda: len(list(pid_dir.glob("*.pids"))) == 3)
        pids = [int(x) for f in pid_dir.glob("*.pids") for x in f.read_text().split()]
        assert len(pids) == 6 and all(process_alive(p) for p in pids)
        cli("cancel", run_id, check_rc=0)
        assert _wait(lambda: not any(process_alive(p) for p in pids), timeout=15), [p for p in pids if process_alive(p)]
        assert launcher.wait(timeout=30) == 1  # the launcher notices and reports the cancellation
        assert "cancelled" in launcher.stdout.read()
        assert json.loads(cli("status", run_id, "--json").stdout)["record"]["state"] == "STOPPED"
        cli("cancel", run_id, check_rc=0)  # idempotent
    finally:
        launcher.kill()


def test_timeout_is_enforced_and_kills_the_tree(tmp_path):
    ex = LocalProcessExecutor()
    (tmp_path / "hang.py").write_text(
        "import subprocess, sys, time\n"
        "def main(ctx):\n"
        "    p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "    print('child', p.pid, flush=True)\n"
        "    time.sleep(600)\n")
    (h,) = launch(ex, 1, "hang:main", {}, timeout=1.5, run_id="t-timeout", workdir=str(tmp_path))
    (res,) = ex.collect([h], timeout=30)
    assert res.status == "failed" and res.exit_code == 124 and "timed out after 1.5s" in res.error
    # the replica's last words say it too: a backend that only has logs (its exit code SIGKILL's 137)
    # reads the time limit from them (`diloco.bootstrap.failures.is_time_limit`)
    from diloco.bootstrap.failures import cause_from_log, is_time_limit

    assert is_time_limit(137, cause_from_log(ex.stream_logs(h))), ex.stream_logs(h)
    child = int(ex.stream_logs(h).split("child ")[1].split()[0])
    assert _wait(lambda: not process_alive(child), timeout=5)


def test_command_entrypoint_and_env_contract(tmp_path):
    script = tmp_path / "show.py"
    script.write_text("import os\nprint(os.environ['MY_RANK'], os.environ['DILOCO_REPLICAS'], os.environ['LR'],"
                      " os.environ['DILOCO_RENDEZVOUS'])\n")
    ex = LocalProcessExecutor()
    handles = launch(ex, 2, ["python", str(script)], {"rank_env": "MY_RANK", "lr": 0.5},
                     rendezvous="file:///tmp/x", run_id="t-cmd", workdir=str(tmp_path))
    results = ex.collect(handles, timeout=30)
    assert [r.status for r in results] == ["succeeded", "succeeded"]
    assert ex.stream_logs(handles[1]).strip() == "1 2 0.5 file:///tmp/x"
    (bad,) = launch(ex, 1, ["python", "-c", "raise SystemExit(3)"], run_id="t-cmd2", workdir=str(tmp_path))
    (res,) = ex.collect([bad], timeout=30)
    assert res.status == "failed" and res.exit_code == 3


def test_killed_replica_is_failed_with_reason(tmp_path):
    (tmp_path / "slow.py").write_text("import time\ndef main(ctx):\n    print('working', flush=True)\n"
                                      "    time.sleep(600)\n")
    ex = LocalProcessExecutor()
    (h,) = launch(ex, 1, "slow:main", run_id="t-kill", workdir=str(tmp_path))
    # kill it only once it has said something: under load "running" comes well before its first line
    assert _wait(lambda: ex.poll(h) == "running" and "working" in ex.stream_logs(h))
    os.kill(h.metadata["pid"], signal.SIGKILL)
    (res,) = ex.collect([h], timeout=10)
    assert res.status == "failed" and "killed by SIGKILL" in res.error and "working" in res.error
    # a fresh executor (another process) has no exit code but still knows it failed
    assert LocalProcessExecutor().poll(ReplicaHandle.from_json(h.to_json())) == "failed"


def test_dryrun_redacts_declared_and_conventional_secrets(cli, project, monkeypatch):
    spec = write_spec(project, 'backend = "local"\nreplicas = 2\nentrypoint = "job:main"\n'
                               'secrets = ["WANDB_API_KEY", "MY_PLAIN_NAMED"]\n'
                               '[env]\nTOKENIZERS_PARALLELISM = "false"\nVISIBLE = "yes-visible"\n')
    proc = cli("dryrun", str(spec), env={"WANDB_API_KEY": "wandb-secret-2", "MY_PLAIN_NAMED": "plain-secret-3"},
               check_rc=0)
    for secret in ("wandb-secret-2", "plain-secret-3"):
        assert secret not in proc.stdout
    plan = json.loads(proc.stdout)
    env = plan["processes"][1]["env"]
    assert env["VISIBLE"] == "yes-visible" and env["REPLICA_RANK"] == "1" and env["DILOCO_REPLICAS"] == "2"
    assert env["TOKENIZERS_PARALLELISM"] == "false"  # not every name with TOKEN in it is a secret
    assert env["MY_PLAIN_NAMED"] == env["WANDB_API_KEY"] == "REDACTED"


def test_secrets_reach_replicas_but_never_the_records(cli, project, state_dir):
    (project / "sec.py").write_text("import os\ndef main(ctx):\n    assert os.environ['HF_TOKEN'] == 'tok-123'\n")
    spec = write_spec(project, 'backend = "local"\nreplicas = 2\nentrypoint = "sec:main"\nsecrets = ["HF_TOKEN"]\n'
                               '[restart]\nmonitor_interval = 0.1\npolicy = "never"\n')
    cli("run", str(spec), env={"HF_TOKEN": "tok-123"}, check_rc=0)
    for path in Path(state_dir).rglob("*"):
        if path.is_file() and not path.name.endswith(".log"):
            assert "tok-123" not in path.read_text(errors="replace"), path
