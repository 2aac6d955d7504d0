"""examples/hf-causal-lm: a transformers Llama trained with DiLoCo, run as a user runs it (a few
rounds of it, on two local replicas), ending with every replica on the same global model."""

from __future__ import annotations

import json

import pytest

from conftest import ROOT, one_global_model, record_of

pytest.importorskip("transformers")


def test_transformers_llama_trains_with_diloco(cli, tmp_path, state_dir):
    text = (ROOT / "examples" / "hf-causal-lm" / "diloco.toml").read_text()
    text = text.replace("replicas = 4", "replicas = 2").replace("total_steps = 600", "total_steps = 45")
    text = text.replace("sync_every = 50", "sync_every = 15").replace("eval_every = 100", "eval_every = 15")
    text = text.replace('entrypoint = "train:train"', f'entrypoint = "train:train"\nworkdir = "{ROOT / "examples" / "hf-causal-lm"}"')
    spec = tmp_path / "diloco.toml"
    spec.write_text(text)
    proc = cli("run", str(spec), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "round 3  members [0, 1]" in proc.stdout
    run_id = proc.stdout.split()[1].rstrip(":")
    record = record_of(state_dir, run_id)
    one_global_model(record)
    results = [r["result"] for r in record["ranks"]]
    assert all(3_000_000 < r["parameters"] < 4_000_000 for r in results)  # a few million, from the config
    assert results[0]["eval_loss"] < 4.5  # from ln(256) = 5.55 at θ₀: it learned something in 45 steps
    status = json.loads(cli("status", run_id, "--json").stdout)
    assert sum(len(r["evals"]) for r in status["rounds"]) >= 2  # eval points reported through DiLoCo
    assert (state_dir / "runs" / run_id / "artifacts" / "loss.png").exists()


def test_the_python_api_sweep_example_runs_and_compares(tmp_path, state_dir):
    """examples/python-api/sweep.py, shortened: two runs launched from dicts, followed, compared."""
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "python-api" / "sweep.py"), "--outer-lr", "0.7",
                           "1.0", "--steps", "50", "--replicas", "2"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "DILOCO_STATE_DIR": str(state_dir)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert [o["outer_lr"] for o in lines] == [0.7, 1.0]
    assert all(o["same_model_everywhere"] and o["rounds"] == 1 for o in lines)  # one round of H = 50: the outer step taken
    assert proc.stdout.splitlines()[-1].startswith("best outer_lr ")
    for o in lines:  # ordinary runs: the CLI sees them
        assert record_of(state_dir, o["run"])["state"] == "SUCCEEDED"
