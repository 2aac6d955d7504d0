"""Issue 24's findings on the launcher side, each as a user or an attacker would hit it.

Specs: non-finite and unbounded numbers, NUL bytes, huge and deeply nested values, reserved and
cloud variables through every door, credentials in URIs (never echoed), secret-looking names at
any depth and in sink options, `dryrun` with an unset secret. Supervision: one supervisor per
run (a lease), run ids with 64 random bits, user text shown as text.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time

import pytest

from conftest import write_spec

GOOD = 'backend = "local"\nreplicas = 2\nentrypoint = "job:main"\n'


def refused(cli, project, state_dir, text: str, *, env: dict | None = None, command: str = "run") -> str:
    """The one error line `diloco run` gives for `text`, checked to have recorded nothing."""
    proc = cli(command, str(write_spec(project, text)), env=env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not (state_dir / "runs").exists() or not any((state_dir / "runs").iterdir())
    return lines[0]


@pytest.mark.parametrize("text, expected", [
    # `timeout = nan` disabled the watchdog; `monitor_interval = inf` crashed the launcher after
    # launch; `backoff = nan` never relaunched a rank and put NaN into run.json
    (GOOD + "timeout = nan\n", "`timeout` must be a finite number"),
    (GOOD + "[restart]\nmonitor_interval = inf\n", "`restart.monitor_interval` must be a finite number"),
    (GOOD + "[restart]\nbackoff = nan\n", "`restart.backoff` must be a finite number"),
    (GOOD + "[restart]\nbackoff = 1e300\n", "`restart.backoff` must be at most 3600"),
    (GOOD + "timeout = 1e12\n", "`timeout` must be at most"),
    (GOOD + "[diloco]\nround_timeout = 1e9\n", "`diloco.round_timeout` must be at most"),
    # a NUL byte or a 10 MB value passed the dry run, then failed at launch leaving an INIT record
    (GOOD + '[args]\nname = "a\\u0000b"\n', "`args.name` contains a NUL byte"),
    (GOOD + '[env]\nNOTE = "a\\u0000b"\n', "`env.NOTE` contains a NUL byte"),
    (GOOD + "[args]\nlr = nan\n", "`args.lr` must be a finite number"),
    # the environment a replica starts with: nothing may take over its rank or its interpreter
    (GOOD + 'secrets = ["REPLICA_RANK", "DILOCO_REPLICAS"]\n', "`secrets` entry 'REPLICA_RANK' sets REPLICA_RANK"),
    (GOOD + '[args]\nrank_env = "PATH"\n', "`args.rank_env = 'PATH'` sets PATH"),
    (GOOD + '[args]\nrank_env = "CUDA_VISIBLE_DEVICES"\n', "sets CUDA_VISIBLE_DEVICES"),
    (GOOD + '[args]\nrank_env = "WORLD_SIZE"\n', "sets WORLD_SIZE"),
    (GOOD + '[env]\nPATH = "/tmp/evil"\n', "`env.PATH` sets PATH"),
    (GOOD + '[env]\nLD_PRELOAD = "/tmp/evil.so"\n', "`env.LD_PRELOAD` sets LD_PRELOAD"),
    (GOOD + '[env]\nPYTHONHOME = "/tmp"\n', "`env.PYTHONHOME` sets PYTHONHOME"),
    (GOOD + '[env]\nDILOCO_SETTINGS = "{}"\n', "`env.DILOCO_SETTINGS` sets DILOCO_SETTINGS"),
    (GOOD + '[env]\nAWS_ENDPOINT_URL = "http://evil"\n', "`env.AWS_ENDPOINT_URL` is a cloud credential or store"),
    # secret-looking names at any depth, and in sink options
    (GOOD + '[args.hub]\ntoken = "hf_x"\n', "`args.hub.token` looks like a secret"),
    (GOOD + '[args]\nhftoken = "hf_x"\n', "`args.hftoken` looks like a secret"),
    (GOOD + '[args]\nwandb_key = "k"\n', "`args.wandb_key` looks like a secret"),
    (GOOD + '[args]\nDB_PASS = "p"\n', "`args.DB_PASS` looks like a secret"),
    (GOOD + '[args]\nGITHUB_PAT = "p"\n', "`args.GITHUB_PAT` looks like a secret"),
    (GOOD + '[args]\nsources = [{ url = "x", api_key = "k" }]\n', "`args.sources[0].api_key` looks like a secret"),
    (GOOD + '[metrics]\nsinks = []\n[metrics.tensorboard]\napi_key = "k"\n', "`metrics.tensorboard.api_key` looks"),
    (GOOD + '[metrics]\nsinks = ["tensorboard"]\n[metrics.tensorboard]\nheaders = [{ api_key = "k" }]\n',
     "`metrics.tensorboard.headers[0].api_key` looks like a secret"),
])
def test_a_hostile_spec_is_refused_in_one_line_before_anything_is_recorded(cli, project, state_dir, text, expected):
    assert expected in refused(cli, project, state_dir, text)


def test_a_nested_array_5000_deep_is_refused_without_a_recursion_error(cli, project, state_dir):
    line = refused(cli, project, state_dir, GOOD + "[args]\ndeep = " + "[" * 5000 + "]" * 5000 + "\n")
    assert "nest" in line


def test_a_10_mb_value_is_refused_by_dryrun_as_by_run(cli, project, state_dir):
    text = GOOD + f'[args]\nblob = "{"x" * 10_000_000}"\n'
    assert "a spec is at most 1,048,576" in refused(cli, project, state_dir, text, command="dryrun")
    assert "a spec is at most 1,048,576" in refused(cli, project, state_dir, text)
    text = GOOD + f'[env]\nBLOB = "{"x" * 100_000}"\n'  # within a file's limit, not a value's
    assert "`env.BLOB` is 100,000 characters" in refused(cli, project, state_dir, text, command="dryrun")
    assert "`env.BLOB` is 100,000 characters" in refused(cli, project, state_dir, text)


@pytest.mark.parametrize("uri, secret", [
    ("s3://AKIAEXAMPLEKEY:wJalrXUtnFEMIK7MDENGbPxRfiCY@bucket/runs", "wJalrXUtnFEMIK7MDENGbPxRfiCY"),
    ("https://acct.blob.core.windows.net/c/p?sv=2022-11-02&sig=c2lnbmF0dXJlLXZhbHVl", "c2lnbmF0dXJlLXZhbHVl"),
    ("s3://bucket/runs?X-Amz-Signature=deadbeefcafe1234", "deadbeefcafe1234"),
])
def test_credentials_in_a_rendezvous_are_refused_and_never_echoed(cli, project, state_dir, tmp_path, uri, secret):
    for command in ("dryrun", "run"):
        line = refused(cli, project, state_dir, GOOD + f'rendezvous = "{uri}"\n', command=command)
        assert "carries" in line and "secrets" in line and secret not in line
    # the user's default rendezvous is checked the same way, from the environment and the config file
    line = refused(cli, project, state_dir, GOOD, env={"DILOCO_RENDEZVOUS": uri})
    assert "DILOCO_RENDEZVOUS" in line and secret not in line
    config = tmp_path / "config.toml"
    config.write_text(f'rendezvous = "{uri}"\n')
    line = refused(cli, project, state_dir, GOOD, env={"DILOCO_CONFIG": str(config)})
    assert secret not in line


def test_dryrun_refuses_an_unset_secret_as_run_does(cli, project, state_dir):
    text = GOOD + 'secrets = ["DILOCO_TEST_UNSET_SECRET_X"]\n'
    env = {k: v for k, v in os.environ.items() if k != "DILOCO_TEST_UNSET_SECRET_X"}
    assert refused(cli, project, state_dir, text, command="dryrun", env=env) == \
        refused(cli, project, state_dir, text, env=env)


def test_settable_diloco_knobs_and_rank_names_for_rank_env_still_work(project):
    from diloco.spec.runspec import parse_spec

    spec = parse_spec({"backend": "local", "replicas": 2, "entrypoint": "job:main",
                       "env": {"DILOCO_FAULT_CORRUPT": "1", "NCCL_DEBUG": "INFO", "TOKENIZERS_PARALLELISM": "false"},
                       "args": {"rank_env": "LOCAL_RANK", "max_tokens": 4096},
                       "secrets": ["AWS_ACCESS_KEY_ID", "AWS_ENDPOINT_URL", "HF_TOKEN"]}, base_dir=project)
    assert spec.env["DILOCO_FAULT_CORRUPT"] == "1" and spec.args["max_tokens"] == 4096
    for name in ("REPLICA_RANK", "RANK", "GROUP_RANK"):  # names that hold a rank
        parse_spec({"backend": "local", "replicas": 2, "entrypoint": "job:main", "args": {"rank_env": name}},
                   base_dir=project)


# -- run ids ----------------------------------------------------------------------------------------


def test_run_ids_carry_64_random_bits_and_stay_dns_labels():
    from diloco.runrecord.state import RUN_ID, new_run_id

    ids = [new_run_id(name) for name in ("tiny-lm", "x" * 200, "9 lives", "日本語") for _ in range(500)]
    assert len(set(ids)) == len(ids)
    for run_id in ids:
        assert RUN_ID.match(run_id) and len(run_id) <= 63
        assert len(run_id.rsplit("-", 1)[1]) == 16  # 16 hex characters: 64 bits


# -- one supervisor per run ------------------------------------------------------------------------


def _race_for_lease(run_dir: str, start_at: float, queue, everyone_answered) -> None:
    from pathlib import Path

    from diloco.supervise.lease import LeaseHeld, SupervisorLease

    while time.time() < start_at:
        pass
    try:
        lease = SupervisorLease.acquire(Path(run_dir))
        queue.put(("won", os.getpid()))
        everyone_answered.wait(60)  # held until every racer has tried: one that started late (a loaded
        lease.release()             # machine) must meet it held, not find it released and win again
    except LeaseHeld as exc:
        queue.put(("refused", str(exc)))


def test_of_many_supervisors_started_together_exactly_one_holds_the_lease(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ctx = multiprocessing.get_context("spawn")
    queue, everyone_answered = ctx.Queue(), ctx.Event()
    start_at = time.time() + 2.0
    procs = [ctx.Process(target=_race_for_lease, args=(str(run_dir), start_at, queue, everyone_answered))
             for _ in range(6)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=60) for _ in procs]
    everyone_answered.set()
    for p in procs:
        p.join(30)
    won = [r for r in results if r[0] == "won"]
    assert len(won) == 1, results
    assert all("already supervised by" in r[1] for r in results if r[0] == "refused"), results


def dead_holders_lease(tmp_path):
    """A run directory whose lease names a process of this host that has exited."""
    from diloco.supervise import lease as lease_mod

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path = run_dir / lease_mod.LEASE_FILE
    path.write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": 1.0, "token": "old",
                                "taken_at": time.time()}))
    return run_dir, path


def test_a_dead_holders_lease_is_taken_over_and_a_live_one_is_not(tmp_path, monkeypatch):
    from diloco.supervise import lease as lease_mod
    from diloco.supervise.lease import LeaseHeld, LeaseHolder, SupervisorLease, current_holder

    run_dir, path = dead_holders_lease(tmp_path)
    assert current_holder(run_dir) is None
    held = SupervisorLease.acquire(run_dir)  # the same host, its process gone: no wait
    assert current_holder(run_dir).token == held.holder.token
    with pytest.raises(LeaseHeld, match=f"process {os.getpid()}"):
        SupervisorLease.acquire(run_dir)
    # another host's lease is live while it is renewed, and expired TTL seconds after
    held.release()
    other = {"pid": 1, "host": "some-other-host", "started": None, "token": "remote", "taken_at": time.time()}
    path.write_text(json.dumps(other))
    with pytest.raises(LeaseHeld, match="some-other-host"):
        SupervisorLease.acquire(run_dir)
    stale = time.time() - lease_mod.TTL - 5
    os.utime(path, (stale, stale))
    taken = SupervisorLease.acquire(run_dir)
    assert LeaseHolder.read(path)[0].token == taken.holder.token
    # the old holder, back from a stall, sees it lost the lease at its next renewal
    monkeypatch.setattr(lease_mod, "RENEW_EVERY", 0.05)
    loser = SupervisorLease.__new__(SupervisorLease)
    loser.__init__(path, LeaseHolder(1, "some-other-host", None, "remote", 0.0))
    deadline = time.time() + 5
    while not loser.lost and time.time() < deadline:
        time.sleep(0.05)
    assert loser.lost
    loser.release()  # does not remove the lease it lost
    assert path.exists()
    taken.release()
    assert not path.exists()


def test_a_racer_that_finds_a_takeover_under_way_waits_and_names_the_new_holder(tmp_path):
    """Two resumes both find a dead launcher's lease; the one that loses the takeover race used
    to say only "being taken over right now" (CI saw it): it now names who supervises."""
    import threading

    from diloco.supervise import lease as lease_mod
    from diloco.supervise.lease import LeaseHeld, SupervisorLease

    run_dir, path = dead_holders_lease(tmp_path)
    guard = path.with_name(path.name + ".takeover")
    guard.touch()  # another racer is mid-takeover

    def finish_the_other_takeover() -> None:
        time.sleep(0.3)
        path.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": None,
                                    "token": "winner", "taken_at": time.time()}))
        guard.unlink()

    threading.Thread(target=finish_the_other_takeover).start()
    with pytest.raises(LeaseHeld, match=f"already supervised by process {os.getpid()}"):
        SupervisorLease.acquire(run_dir)
    assert json.loads(path.read_text())["token"] == "winner"


def test_two_resumes_started_together_one_supervises_and_the_other_names_it(cli, project, state_dir):
    """Two `diloco resume` of a run whose launcher died: before the lease both passed the
    liveness check and the run got two live rank-0 replicas."""
    spec = write_spec(project, GOOD + "[args]\nsteps = 4000\ndelay = 0.05\n[restart]\nmonitor_interval = 0.1\n")
    env = {**os.environ, "DILOCO_STATE_DIR": str(state_dir)}
    launcher = subprocess.Popen([sys.executable, "-m", "diloco", "run", str(spec)], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        run_id = None
        deadline = time.time() + 60
        while time.time() < deadline and run_id is None:
            runs = list((state_dir / "runs").glob("*/run.json")) if (state_dir / "runs").exists() else []
            for p in runs:
                if json.loads(p.read_text()).get("state") == "HEALTHY":
                    run_id = p.parent.name
            time.sleep(0.1)
        assert run_id, "the run never became HEALTHY"
        launcher.kill()  # SIGKILL: the launcher dies, its replicas live on
        launcher.wait(10)
        resumes = [subprocess.Popen([sys.executable, "-m", "diloco", "resume", run_id], env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
        deadline = time.time() + 90
        while time.time() < deadline and all(r.poll() is None for r in resumes):
            time.sleep(0.2)
        time.sleep(1.0)
        finished = [r for r in resumes if r.poll() is not None]
        assert len(finished) == 1, "exactly one resume must be refused, at once"
        out, err = finished[0].communicate()
        assert finished[0].returncode == 2 and "is already supervised by process" in err, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
        still = next(r for r in resumes if r.poll() is None)
        cli("cancel", run_id, check_rc=0)
        still.communicate(timeout=60)
        events = [json.loads(line)["event"] for line in (state_dir / "runs" / run_id / "events.jsonl").open()]
        assert events.count("resumed") == 1
    finally:
        if launcher.poll() is None:
            launcher.kill()


def test_the_python_api_cannot_supervise_a_run_another_launcher_holds(cli, project, state_dir, monkeypatch):
    """`diloco.attach(id).supervise()` from a notebook while `diloco run` supervises the run: refused
    in one line naming the holder, and the run goes on untouched (one rank-0 replica, not two)."""
    import diloco
    from diloco.errors import UserError

    spec = write_spec(project, GOOD + "[args]\nsteps = 4000\ndelay = 0.05\n[restart]\nmonitor_interval = 0.1\n")
    monkeypatch.setenv("DILOCO_STATE_DIR", str(state_dir))
    launcher = subprocess.Popen([sys.executable, "-m", "diloco", "run", str(spec)], text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        run_id, deadline = None, time.time() + 60
        while time.time() < deadline and run_id is None:
            for p in (state_dir / "runs").glob("*/run.json") if (state_dir / "runs").exists() else []:
                if json.loads(p.read_text()).get("state") == "HEALTHY":
                    run_id = p.parent.name
            time.sleep(0.1)
        assert run_id, "the run never became HEALTHY"
        with pytest.raises(UserError, match=f"already supervised by process {launcher.pid}") as refused:
            diloco.attach(run_id).supervise()
        assert "\n" not in str(refused.value)
        assert launcher.poll() is None and diloco.attach(run_id).state == "HEALTHY"
        events = [json.loads(line)["event"] for line in (state_dir / "runs" / run_id / "events.jsonl").open()]
        assert "resumed" not in events
        cli("cancel", run_id, check_rc=0)
        launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()


# -- output ---------------------------------------------------------------------------------------


def test_user_text_in_records_is_shown_as_text_by_list_and_status(cli, state_dir):
    from diloco.runrecord.state import RunRecord

    spec = {"name": "markup", "backend": "[/][link=http://evil]x", "replicas": 2, "entrypoint": "job:main",
            "workdir": ".", "timeout": 60.0}
    record = RunRecord.create("markup-run", {"spec": spec,
                                             "state": "[bold]FAILED[/]", "launch": {"n_replicas": 2}})
    assert record.path.exists()
    proc = cli("list")
    assert proc.returncode == 0, proc.stderr
    assert "[link=http://evil]" in proc.stdout and "Traceback" not in proc.stderr


# -- what the launcher reads from the store --------------------------------------------------------


@pytest.mark.parametrize("field, value", [("loss", "x"), ("incidents", [1, 2]), ("members", "all"),
                                          ("tokens", 1e400), ("rows", {"a": 1}), ("evals", [["x"]]),
                                          ("bytes_up", True)])
def test_a_planted_round_summary_of_the_wrong_shape_is_skipped_not_a_crash(field, value):
    """Anyone with the store's credentials can write a summary: valid JSON of the wrong shape used
    to reach the launcher's progress code (`round("x", 4)`, `inc.items()`) and crash it."""
    import uuid

    from diloco.store.metrics import RoundMetrics, RoundReader, RoundSummary
    from diloco.store.runkeys import RunKeys
    from diloco.store.objectstore import open_store

    store = open_store(f"memory://{uuid.uuid4().hex}")
    good = RoundSummary.from_rows(1, [RoundMetrics(round=1, rank=0, members=[0], loss=1.5, tokens=10)])
    store.put(RunKeys("run").summary(1), good.to_json())
    bad = json.loads(RoundSummary.from_rows(2, [RoundMetrics(round=2, rank=0, members=[0])]).to_json())
    bad[field] = value
    store.put(RunKeys("run").summary(2), json.dumps(bad).encode())
    store.put(RunKeys("run").summary(3), b"[" * 100_000)  # deeper than json can decode
    got = RoundReader(store, "run").read_new()
    assert [s.round for s in got] == [1] and got[0].loss == 1.5


def test_rows_and_summaries_are_valid_json_with_nan_values():
    from diloco.store.metrics import RoundMetrics, RoundSummary

    row = RoundMetrics(round=1, rank=0, members=[0], loss=float("nan"),
                       evals=[[5, float("nan")]])
    text = RoundSummary.from_rows(1, [row]).to_json().decode()
    assert "NaN" not in text and "Infinity" not in text
    back = RoundMetrics.from_json(row.to_json())
    assert back.loss is None and back.evals == []  # no loss, and no point on the eval curve


def test_a_runspec_built_in_python_is_checked_as_a_parsed_one(project, state_dir):
    """`diloco.launch(RunSpec(...))` used to skip every check a spec file gets."""
    import dataclasses

    import diloco
    from diloco.errors import SpecError
    from diloco.spec.runspec import parse_spec

    good = parse_spec({"backend": "local", "replicas": 2, "entrypoint": "job:main"}, base_dir=project)
    assert parse_spec(good.to_table(), base_dir=project) == good
    for hostile, expected in [({"env": {"LD_PRELOAD": "/tmp/evil.so"}}, "sets LD_PRELOAD"),
                              ({"timeout": float("nan")}, "must be a finite number"),
                              ({"rendezvous": "s3://AKIA:hunter2@bucket/x"}, "credentials")]:
        with pytest.raises(SpecError, match=expected) as info:
            diloco.launch(dataclasses.replace(good, **hostile), background=False)
        assert "hunter2" not in str(info.value)
    assert not (state_dir / "runs").exists() or not list((state_dir / "runs").iterdir())  # nothing recorded
