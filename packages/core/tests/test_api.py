"""The Python API (`diloco.launch`, `diloco.attach`): what a notebook or sweep script sees.

Replicas are real local processes; "another process" is a real second Python process attaching
by run id, as a second notebook or shell would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

import diloco
from diloco.errors import SpecError
from diloco.supervise.supervisor import RunFailed


def spec_dict(project, **over):
    spec = {"name": "api", "backend": "local", "replicas": 3, "entrypoint": "job:main", "workdir": str(project),
            "args": {"steps": 3}, "restart": {"monitor_interval": 0.1, "policy": "never"}}
    spec.update(over)
    return spec


def attach_from_another_process(run_id: str, code: str) -> str:
    """Run `code` with `run` bound to diloco.attach(run_id) in a fresh interpreter; its stdout."""
    prog = f"import diloco, json\nrun = diloco.attach({run_id!r})\n{code}\n"
    return subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, check=True,
                          env=os.environ.copy(), timeout=60).stdout


def test_launch_from_a_dict_waits_and_returns_every_ranks_result(project, state_dir, cli):
    run = diloco.launch(spec_dict(project))
    assert run.wait(timeout=60) == "SUCCEEDED" and run.done
    results = run.results()
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert len({r["pid"] for r in results}) == 3  # three real processes
    assert [r.status for r in run.ranks()] == ["succeeded"] * 3
    assert "rank 2/3 step 2" in run.logs(rank=2)[2]
    assert {e["event"] for e in run.events()} >= {"launch", "run_succeeded"}
    status = run.status()  # what `diloco status RUN --json` prints, from the same code
    assert json.loads(cli("status", run.id, "--json", check_rc=0).stdout).keys() == status.keys()
    assert status["live"] == {0: "succeeded", 1: "succeeded", 2: "succeeded"} and status["live_error"] is None
    json.dumps(status)
    # another process sees the same run, by id
    out = attach_from_another_process(run.id, "print(json.dumps([run.state, run.results(), run.progress().to_dict()]))")
    state, results_there, progress = json.loads(out)
    assert state == "SUCCEEDED" and results_there == results and "step" in progress


def test_launch_from_a_spec_file_and_a_failure_raises_with_every_ranks_error(project, state_dir):
    (project / "diloco.toml").write_text('backend = "local"\nreplicas = 2\nentrypoint = "job:main"\n'
                                         '[args]\nfail_rank = 1\n[restart]\npolicy = "never"\nmonitor_interval = 0.1\n')
    run = diloco.launch(project / "diloco.toml")
    with pytest.raises(RunFailed) as failed:
        run.wait(timeout=60)
    assert "exploded on rank 1" in (failed.value.errors[1] or "")
    assert run.state == "FAILED"
    with pytest.raises(RunFailed):  # and so does waiting from another Run object on the same id
        diloco.attach(run.id).wait(timeout=10)


def test_cancel_from_another_process_stops_a_running_run(project, state_dir):
    run = diloco.launch(spec_dict(project, args={"steps": 2000, "delay": 0.05}))
    deadline = time.monotonic() + 30
    while set(run.live().values()) != {"running"} and time.monotonic() < deadline:
        time.sleep(0.1)
    assert attach_from_another_process(run.id, "print(run.cancel())").strip() == "3"
    assert run.wait(timeout=60) == "STOPPED"
    assert set(run.live().values()) <= {"cancelled", "failed"}
    assert [r.id for r in diloco.runs(limit=1)] == [run.id]


def test_attach_takes_a_unique_prefix_and_bad_input_is_a_clear_error(project, state_dir):
    run = diloco.launch(spec_dict(project))
    run.wait(timeout=60)
    assert diloco.attach(run.id[:-3]).id == run.id
    with pytest.raises(diloco.UserError, match="no run 'nope'"):
        diloco.attach("nope")
    with pytest.raises(SpecError, match="`replicas` must be"):
        diloco.launch(spec_dict(project, replicas="three"))
    with pytest.raises(diloco.UserError, match="nothing to resume"):
        diloco.attach(run.id).supervise()


def test_follow_yields_snapshots_until_the_run_ends(project, state_dir):
    run = diloco.launch(spec_dict(project, args={"steps": 40, "delay": 0.05}))
    snapshots = list(diloco.attach(run.id).follow(interval=0.1))  # returns: the run ended
    assert len(snapshots) > 1 and len({id(s) for s in snapshots}) == len(snapshots)  # each read afresh
    assert [s.ended for s in snapshots] == [False] * (len(snapshots) - 1) + [True]
    assert snapshots[-1].state == "SUCCEEDED" and run.wait(timeout=60) == "SUCCEEDED"
    _, offset = snapshots[-1].events_after(0)
    assert offset > 0 and {e["event"] for e in snapshots[-1].events()} >= {"launch", "run_succeeded"}


def test_follow_stops_on_a_run_that_no_launcher_supervises(project, state_dir):
    run = diloco.launch(spec_dict(project), background=False)  # recorded, never supervised
    path = run.record.path
    data = json.loads(path.read_text())
    data["updated_at"] -= 60  # silent for longer than a live launcher's heartbeat allows
    path.write_text(json.dumps(data))
    follow = diloco.attach(run.id).follow(interval=0.01)
    assert not next(follow).ended
    with pytest.raises(diloco.UserError, match=f"no launcher is supervising run {run.id}.*diloco resume"):
        next(follow)


def test_follow_logs_prints_one_replicas_output_until_it_ends(project, state_dir):
    run = diloco.launch(spec_dict(project, replicas=1, args={"steps": 8, "delay": 0.1}))
    text = "".join(diloco.attach(run.id).follow_logs(lines=50))  # one replica: no rank to name
    assert [line for line in text.splitlines() if " step " in line] == [f"rank 0/1 step {i}" for i in range(8)]
    assert run.wait(timeout=60) == "SUCCEEDED"
    two = diloco.launch(spec_dict(project, replicas=2))
    with pytest.raises(diloco.UserError, match="2 replicas match; follow_logs follows one"):
        two.follow_logs()
    two.wait(timeout=60)
