"""The state directory: run ids name a directory in it and nothing else; it is private; its
records are valid JSON and never overwritten."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from conftest import write_spec
from diloco.errors import RunNotFound, UserError
from diloco.runrecord.state import RunRecord


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("run_id", ["", "/etc", "../../x", "**", "a*", "run/../../etc", "RUN", "a" * 64, "a b"])
def test_a_run_id_that_is_a_path_a_glob_or_empty_is_refused_in_one_line(state_dir, tmp_path, run_id):
    RunRecord.create("only-run", {"state": "HEALTHY"})
    with pytest.raises(RunNotFound, match="is not a run id or the start of one"):
        RunRecord.load(run_id)


@pytest.mark.parametrize("command", ["cancel", "status", "logs"])
@pytest.mark.parametrize("run_id", ["", "/etc", "../../x", "**"])
def test_the_cli_refuses_a_path_a_glob_or_an_empty_run_id_and_leaves_the_run_alone(state_dir, tmp_path, run_id,
                                                                                       command):
    """`diloco cancel ""` once cancelled the only run; `../../x` listed files outside the state
    dir in its hint; `**` and `/etc` ended in tracebacks."""
    outside = tmp_path / "outside-the-state-dir"
    outside.mkdir()
    (tmp_path / "x-secret-file").write_text("")  # what <state>/runs/../../x* would match
    RunRecord.create("only-run", {"state": "HEALTHY"})
    proc = subprocess.run([sys.executable, "-m", "diloco", command, run_id], capture_output=True, text=True,
                          cwd=outside, env={**os.environ, "DILOCO_STATE_DIR": str(state_dir)})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert "is not a run id" in line and "x-secret-file" not in line and "only-run" not in line
    assert RunRecord.load("only-run").data["state"] == "HEALTHY"  # nothing was cancelled


def test_a_planted_record_outside_the_state_dir_is_never_loaded(state_dir, tmp_path):
    planted = tmp_path / "elsewhere"
    planted.mkdir()
    (planted / "run.json").write_text(json.dumps({"run_id": "x", "launcher": {"pid": os.getpid()}}))
    proc = subprocess.run([sys.executable, "-m", "diloco", "cancel", str(planted)], capture_output=True, text=True,
                          env={**os.environ, "DILOCO_STATE_DIR": str(state_dir)})
    assert proc.returncode == 2 and "is not a run id" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_prefix_matches_literally(state_dir):
    RunRecord.create("tiny-20260101-000000-ab12", {})
    RunRecord.create("tiny-20260101-000001-cd34", {})
    assert RunRecord.load("tiny-20260101-000001").run_id == "tiny-20260101-000001-cd34"
    with pytest.raises(RunNotFound, match="did you mean one of"):
        RunRecord.load("tiny-2026")


def test_the_state_dir_and_its_records_are_private(state_dir):
    record = RunRecord.create("private-run", {"state": "HEALTHY"})
    record.event("round", loss=1.0)
    record.request_cancel()
    assert _mode(state_dir) == 0o700 and _mode(state_dir / "runs") == 0o700 and _mode(record.dir) == 0o700
    assert _mode(record.path) == 0o600 and _mode(record.events_path) == 0o600


def _run_leaving_files(cli, project, tmp_path, *, rounds: bool = False) -> str:
    """A small local run whose replicas leave logs, results, an artifact and (with `rounds`) a
    round summary in a file store; its run id."""
    (project / "leave.py").write_text(
        "def main(ctx):\n"
        "    print('training data: secret-ish', flush=True)\n"
        "    ctx.store.put(f'{ctx.run_id}/artifacts/summary.txt', b'final loss 1.5\\n')\n"
        "    if ctx.rank == 0 and %r:\n"
        "        from diloco.store.metrics import RoundMetrics, RoundSummary\n"
        "        from diloco.store.runkeys import RunKeys\n"
        "        row = RoundMetrics(round=1, rank=0, members=[0, 1], loss=1.5, tokens=10)\n"
        "        ctx.store.put(RunKeys(ctx.run_id).summary(1), RoundSummary.from_rows(1, [row]).to_json())\n"
        "    return {'rank': ctx.rank}\n" % rounds)
    store = tmp_path / "store"
    store.mkdir()
    spec = write_spec(project, f'backend = "local"\nreplicas = 2\nentrypoint = "leave:main"\n'
                               f'rendezvous = "file://{store}"\n[restart]\nmonitor_interval = 0.1\npolicy = "never"\n')
    proc = cli("run", str(spec), check_rc=0)
    return proc.stdout.split()[1].rstrip(":")


def _not_private(state_dir) -> list[str]:
    """Everything under the state dir that another user could read: directories not 0700, files not 0600."""
    return [f"{path.relative_to(state_dir)} {_mode(path):o}" for path in state_dir.rglob("*")
            if _mode(path) != (0o700 if path.is_dir() else 0o600)]


def test_everything_a_local_run_leaves_in_the_state_dir_is_private(cli, project, state_dir, tmp_path):
    """Not only run.json and events.jsonl: the replicas' logs and result files, and the artifacts
    copied from the store, were created 0644 (readable by every user of a shared machine)."""
    run_id = _run_leaving_files(cli, project, tmp_path)
    artifacts = state_dir / "runs" / run_id / "artifacts"
    assert (artifacts / "summary.txt").read_text() == "final loss 1.5\n"
    logs = list((state_dir / "local" / run_id).glob("rank-*.log"))
    results = list((state_dir / "local" / run_id).glob("rank-*.result.json"))
    assert len(logs) == len(results) == 2 and "secret-ish" in logs[0].read_text()
    assert _not_private(state_dir) == []


def test_the_rounds_a_run_caches_are_private(cli, project, state_dir, tmp_path):
    run_id = _run_leaving_files(cli, project, tmp_path, rounds=True)
    assert (state_dir / "runs" / run_id / "rounds.jsonl").exists()
    assert _not_private(state_dir) == []


def test_records_and_events_are_valid_json_even_with_a_nan_loss(state_dir):
    record = RunRecord.create("nan-run", {"state": "HEALTHY", "last_loss": float("nan")})
    record.event("round", round=3, members=2, loss=float("nan"), grad=float("-inf"))
    json.loads(record.path.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in run.json"))
    line = record.events_path.read_text().splitlines()[0]
    event = json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in events.jsonl"))
    assert event["loss"] == "nan" and event["grad"] == "-inf"
    from diloco.observe.display import format_any, format_round

    # what the launcher prints of that round, read back from the record: shown, not a crash
    assert "loss nan" in format_round({"round": 3, "members": 2, "loss": event["loss"]})
    assert "loss nan" in format_any(event)


def test_a_recorded_run_is_never_overwritten(state_dir):
    RunRecord.create("same-id", {"state": "HEALTHY", "marker": 1})
    with pytest.raises(UserError, match="already recorded"):
        RunRecord.create("same-id", {"state": "INIT"})
    assert RunRecord.load("same-id").data["marker"] == 1


def test_an_error_holding_rich_markup_is_shown_as_text(state_dir):
    from rich.console import Console

    from diloco.observe.display import status_table
    from diloco.runrecord.rankstate import RankState

    rank = RankState(0)
    rank.last_error = "ValueError: [/] closed nothing [link=https://evil.example]click[/link]"
    record = RunRecord.create("markup-run", {"state": "FAILED", "ranks": [rank.to_dict()]})
    console = Console(width=200, record=True)
    console.print(status_table(record, None))  # rich read "[/]" as markup and raised MarkupError
    assert "[/] closed nothing [link=https://evil.example]click[/link]" in console.export_text()
