"""The main job end to end: `diloco run` of the tiny-LM DiLoCo example on local replicas."""

from __future__ import annotations

import json

from conftest import tiny_spec


def test_tiny_lm_runs_reports_and_records(cli, tmp_path, state_dir):
    spec = tiny_spec(tmp_path, steps=120, sync_every=20, model="main")
    proc = cli("run", str(spec))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "round 6  members [0, 1, 2, 3]" in out
    assert "eval loss" in out and "per-step data-parallel" in out and "sync share of wall" in out
    run_id = out.split()[1].rstrip(":")
    artifacts = state_dir / "runs" / run_id / "artifacts"
    assert (artifacts / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (artifacts / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((artifacts / "summary.json").read_text())
    assert summary["rounds"] == 6 and summary["eval_loss"] < 4.0
    assert summary["communication_reduction"] > 10
    status = cli("status", run_id)
    assert status.returncode == 0 and "rounds: 6" in status.stdout and "loss" in status.stdout
    data = json.loads(cli("status", run_id, "--json").stdout)
    assert len(data["rounds"]) == 6 and data["rounds"][-1]["members"] == [0, 1, 2, 3]
