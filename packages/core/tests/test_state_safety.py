"""The state directory: run ids name a directory in it and nothing else; it is private; its
records are valid JSON and never overwritten."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from diloco.errors import RunNotFound, UserError
from diloco.state import RunRecord


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("run_id", ["", "/etc", "../../x", "**", "a*", "run/../../etc", "RUN", "a" * 64, "a b"])
def test_a_run_id_that_is_a_path_a_glob_or_empty_is_refused_in_one_line(state_dir, tmp_path, run_id):
    RunRecord.create("only-run", {"state": "HEALTHY"})
    with pytest.raises(RunNotFound, match="is not a run id or the start of one"):
        RunRecord.load(run_id)


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


def test_records_and_events_are_valid_json_even_with_a_nan_loss(state_dir):
    record = RunRecord.create("nan-run", {"state": "HEALTHY", "last_loss": float("nan")})
    record.event("round", round=3, members=2, loss=float("nan"), grad=float("-inf"))
    json.loads(record.path.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in run.json"))
    line = record.events_path.read_text().splitlines()[0]
    event = json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in events.jsonl"))
    assert event["loss"] == "nan" and event["grad"] == "-inf"
    from diloco.display import format_any, format_round

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

    from diloco.display import status_table
    from diloco.rankstate import RankState

    rank = RankState(0)
    rank.last_error = "ValueError: [/] closed nothing [link=https://evil.example]click[/link]"
    record = RunRecord.create("markup-run", {"state": "FAILED", "ranks": [rank.to_dict()]})
    console = Console(width=200, record=True)
    console.print(status_table(record, None))  # rich read "[/]" as markup and raised MarkupError
    assert "[/] closed nothing [link=https://evil.example]click[/link]" in console.export_text()
