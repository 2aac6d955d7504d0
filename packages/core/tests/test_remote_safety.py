"""Runs that cannot meet are refused before launch; failures a relaunch cannot fix end the run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import one_line_error, write_spec

# A third-party backend that says nothing about filesystems: it must be treated as remote.
REMOTE_PLUGIN = '''
from diloco import hookimpl
from diloco.local.executor import LocalProcessExecutor
from diloco.protocol import Capabilities

class FarAwayExecutor(LocalProcessExecutor):
    backend_name = "faraway"
    capabilities = Capabilities()  # declares nothing: remote, no relaunch of one rank

class DeclaredRemoteExecutor(LocalProcessExecutor):
    backend_name = "declared-remote"
    capabilities = Capabilities(relaunches_one_rank=True, process_groups=True)  # no shared disk declared

@hookimpl
def diloco_register_executors():
    return [FarAwayExecutor, DeclaredRemoteExecutor]
'''


@pytest.fixture
def remote_env(project):
    (project / "faraway_plugin.py").write_text(REMOTE_PLUGIN)
    return {"DILOCO_PLUGINS": "faraway_plugin", "PYTHONPATH": str(project), "DILOCO_CONFIG": str(project / "none.toml")}


def test_file_rendezvous_refused_for_a_backend_on_other_machines(cli, project, remote_env, state_dir):
    spec = write_spec(project, 'backend = "faraway"\nreplicas = 2\nentrypoint = "job:main"\n'
                               'rendezvous = "file:///tmp/shared-store"\n')
    for cmd in ("run", "dryrun"):
        one_line_error(cli(cmd, str(spec), env=remote_env), "which 'faraway' replicas do not see")
        declared = write_spec(project, 'backend = "declared-remote"\nreplicas = 2\nentrypoint = "job:main"\n'
                                       'rendezvous = "file:///tmp/shared-store"\n', name="declared.toml")
        one_line_error(cli(cmd, str(declared), env=remote_env), "which 'declared-remote' replicas do not see")
    assert not (state_dir / "runs").exists() or not any((state_dir / "runs").iterdir())


def test_no_rendezvous_for_a_remote_backend_names_every_fix(cli, project, remote_env):
    spec = write_spec(project, 'backend = "faraway"\nreplicas = 2\nentrypoint = "job:main"\n')
    proc = cli("dryrun", str(spec), env=remote_env)
    one_line_error(proc, "need a shared object store")
    assert "DILOCO_RENDEZVOUS" in proc.stderr and "none.toml" in proc.stderr


def test_user_default_rendezvous_from_env_or_config(cli, project, remote_env):
    spec = write_spec(project, 'backend = "faraway"\nreplicas = 2\nentrypoint = "job:main"\n')
    plan = json.loads(cli("dryrun", str(spec), env={**remote_env, "DILOCO_RENDEZVOUS": "s3://team-bucket/diloco"},
                          check_rc=0).stdout)
    assert {p["env"]["DILOCO_RENDEZVOUS"] for p in plan["processes"]} == {"s3://team-bucket/diloco"}
    (project / "none.toml").write_text('rendezvous = "s3://from-config/x"\n')
    plan = json.loads(cli("dryrun", str(spec), env=remote_env, check_rc=0).stdout)
    assert plan["processes"][0]["env"]["DILOCO_RENDEZVOUS"] == "s3://from-config/x"
    (project / "none.toml").write_text('rendezvous = "file:///tmp/x"\n')
    one_line_error(cli("dryrun", str(spec), env=remote_env), "none.toml: rendezvous 'file:///tmp/x' is a directory")


def test_local_backend_keeps_its_default_store_in_the_records(cli, project, state_dir):
    spec = write_spec(project, 'backend = "local"\nreplicas = 2\nentrypoint = "job:main"\n')
    plan = json.loads(cli("dryrun", str(spec), env={"DILOCO_CONFIG": str(project / "none.toml")}, check_rc=0).stdout)
    assert plan["processes"][0]["env"]["DILOCO_RENDEZVOUS"].startswith((state_dir / "runs").as_uri())


SECRET_LOOKING = [  # (what the spec holds, the key the refusal names)
    ('[args]\nhf_token = "hf-live-0451"', "args.hf_token"),
    ('[args.logging]\napi_key = "sk-live-0451"', "args.logging.api_key"),
    ('[args]\nlayers = [{ width = 8 }, { password = "pw-live-0451" }]', "password"),
    ('[env]\nWANDB_API_KEY = "wandb-live-0451"', "WANDB_API_KEY"),
]


@pytest.mark.parametrize("table, key", SECRET_LOOKING, ids=[k for _, k in SECRET_LOOKING])
def test_secret_looking_args_never_reach_a_plan(cli, project, state_dir, table, key):
    """Through every way in (a spec's args at any depth, its env; `dryrun`, `run`; a request built
    in Python): refused in one line naming the key, the value never printed, nothing recorded."""
    from diloco.errors import UserError
    from diloco.request import LaunchRequest

    spec = write_spec(project, f'backend = "local"\nreplicas = 2\nentrypoint = "job:main"\n{table}\n')
    for command in ("dryrun", "run"):
        proc = cli(command, str(spec))
        assert proc.returncode == 2, (command, proc.stdout, proc.stderr)
        [line] = proc.stderr.strip().splitlines()
        assert "looks like a secret" in line and key in line, line
        assert "live-0451" not in proc.stdout + proc.stderr
    assert not (state_dir / "runs").exists() or not any((state_dir / "runs").iterdir())
    for args in ({"hf_token": "hf-live-0451", "lr": 0.1}, {"logging": {"api_key": "sk-live-0451"}}):
        with pytest.raises(UserError, match="looks like a secret") as refused:
            LaunchRequest(run_id="r1", n_replicas=1, entrypoint="job:main", args=args)
        assert "live-0451" not in str(refused.value)


FAILING = '''
import os, signal
from diloco.errors import UserError

def config_error(ctx):
    raise UserError("rendezvous 's3://nope' could not list objects: access denied")

def same_bug(ctx):
    ctx.global_step = 40
    raise ValueError("shapes (3, 4) and (5, 6) do not match")

def killed_once(ctx, marker: str = ""):
    if ctx.attempt == 0 and ctx.rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    return ctx.rank
'''


def supervised(cli, project, entry: str, extra: str = ""):
    (project / "failing.py").write_text(FAILING)
    spec = write_spec(project, f'backend = "local"\nreplicas = 3\nentrypoint = "failing:{entry}"\n'
                               f'[restart]\nbackoff = 0.1\nmonitor_interval = 0.1\n{extra}')
    proc = cli("run", str(spec), "--on-interrupt", "cancel", timeout=120)
    run_id = proc.stdout.split()[1].rstrip(":")
    return proc, run_id


def record_of(state_dir, run_id):
    return json.loads((state_dir / "runs" / run_id / "run.json").read_text())


def test_a_configuration_error_fails_the_run_without_relaunching(cli, project, state_dir):
    proc, run_id = supervised(cli, project, "config_error")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "configuration error" in proc.stdout and "access denied" in proc.stdout and "Traceback" not in proc.stdout
    record = record_of(state_dir, run_id)
    assert record["restarts_used"] == 0 and record["state"] == "FAILED"
    assert all(r["restarts"] == 0 for r in record["ranks"])


def test_the_same_bug_on_every_rank_fails_fast(cli, project, state_dir):
    proc, run_id = supervised(cli, project, "same_bug", "max_restarts_per_rank = 5\n")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "every rank failed with the same error at the same step" in proc.stdout
    assert "ValueError: shapes (3, 4) and (5, 6) do not match (at global step 40)" in proc.stdout
    assert record_of(state_dir, run_id)["restarts_used"] < 3  # not 3 ranks × 5 budgets


def test_a_signal_is_infrastructure_and_is_relaunched(cli, project, state_dir):
    proc, run_id = supervised(cli, project, "killed_once")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = record_of(state_dir, run_id)
    assert record["ranks"][0]["restarts"] == 1
    events = [json.loads(x) for x in (state_dir / "runs" / run_id / "events.jsonl").read_text().splitlines()]
    failed = [e for e in events if e["event"] == "failed"]
    assert failed and failed[0]["error"].startswith("killed by SIGKILL")  # the cause first, the log tail after


def test_a_paused_launcher_still_counts_as_alive(state_dir):
    """A launcher stopped past its heartbeat (SIGSTOP, laptop asleep) must not get a twin via resume."""
    from diloco.observe.liveness import launcher_alive as _launcher_alive
    from diloco.host.procinfo import started_at
    from diloco.runrecord.state import RunRecord
    import socket

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        record = RunRecord.create("r-paused", {"launcher": {
            "pid": child.pid, "host": socket.gethostname(), "heartbeat": time.time() - 3600,
            "started": started_at(child.pid)}})
        assert _launcher_alive(record)
        record.data["launcher"]["started"] = started_at(child.pid) - 100  # the pid was recycled by another process
        assert not _launcher_alive(record)
    finally:
        child.kill()
        child.wait()
    record.data["launcher"]["started"] = None
    assert not _launcher_alive(record)
