"""The main job end to end: `diloco run` of the tiny-LM DiLoCo example on local replicas, then
its trained model taken out with `diloco export`."""

from __future__ import annotations

import json
import sys

from conftest import ROOT, record_of, tiny_spec


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
    export_reproduces_the_run(cli, tmp_path, state_dir, run_id)


def export_reproduces_the_run(cli, tmp_path, state_dir, run_id: str) -> None:
    """`diloco export` writes the global model of the last round (6; checkpoints are every 10
    rounds, so only the end of training wrote it): loaded into a fresh model of the example's code,
    it has θ_global's digest and evaluates to the loss the replicas reported."""
    import torch
    from safetensors.torch import load_file

    sys.path.insert(0, str(ROOT / "examples" / "tiny-lm"))
    try:
        import tiny_lm
    finally:
        sys.path.pop(0)
    from diloco_replica.outer.step import blocks_digest

    results = [r["result"] for r in record_of(state_dir, run_id)["ranks"]]
    proc = cli("export", run_id, "--out", str(tmp_path / "model"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"run {run_id}: round 6 written to ") and "470,528 parameters" in proc.stdout
    weights = load_file(tmp_path / "model" / "model.safetensors")
    model = tiny_lm.build(0, 64, 128, 2)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and not set(missing) & dict(model.named_parameters()).keys()  # only buffers are its own
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert f"{blocks_digest(theta, 0):016x}" == results[0]["theta_digest"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the replicas evaluated
    try:
        eval_loss = tiny_lm.evaluate(model, tiny_lm.load_corpus()[1], 64)
    finally:
        torch.set_num_threads(threads)
    assert eval_loss == results[0]["eval_loss"]
    again = cli("export", run_id, "--out", str(tmp_path / "model"))
    assert again.returncode == 2 and again.stderr.count("\n") == 1 and "already exists" in again.stderr
    unknown = cli("export", "no-such-run", "--out", str(tmp_path / "other"))
    assert unknown.returncode == 2 and unknown.stderr.startswith("error: no run 'no-such-run'")
