"""examples/lightning: `lightning.Trainer` with `DiLoCoCallback`, run as a user runs it, through the
launcher: replicas on one global model after every round while one is SIGKILLed and relaunched
(it resumes at the run's global step, with the learning rate of that step), the model exported
from the store with the module's parameter names, and replicas of two processes under torchrun
(Lightning's own DDP)."""

from __future__ import annotations

import sys

import pytest

from conftest import ROOT, one_global_model, record_of
from fault_harness import killed_and_relaunched

pytest.importorskip("lightning")

EXAMPLE = ROOT / "examples" / "lightning"
STEPS, H, WARMUP, LR = 200, 10, 30, 2e-3


def spec(tmp_path, *, steps: int = STEPS, extra: str = "") -> str:
    """The example's spec, shortened: a smaller model, no validation during training."""
    text = (EXAMPLE / "diloco.toml").read_text()
    for old, new in [("total_steps = 300", f"total_steps = {steps}"), ("sync_every = 50", f"sync_every = {H}"),
                     ("batch_size = 16", "batch_size = 8"), ("seq_len = 64", "seq_len = 32"),
                     ("val_every = 100", "val_every = 0\ndim = 64\nlayers = 1\nheads = 2\nmax_bytes = 300_000"),
                     ("round_timeout = 300", "round_timeout = 30"),
                     ("parameters = 470528", "parameters = 85000"),
                     ('entrypoint = "train:train"', f'entrypoint = "train:train"\nworkdir = "{EXAMPLE}"')]:
        assert old in text, f"examples/lightning/diloco.toml no longer says {old!r}"
        text = text.replace(old, new)
    path = tmp_path / "diloco.toml"
    path.write_text(text.replace("[restart]\n", "[restart]\nmax_restarts = 4\nbackoff = 0.2\n") + extra)
    return str(path)


def lr_after(steps: int) -> float:
    sys.path.insert(0, str(EXAMPLE))
    try:
        from train import warmup_cosine
    finally:
        sys.path.remove(str(EXAMPLE))
    return LR * warmup_cosine(steps, WARMUP, STEPS)


def test_a_killed_lightning_replica_resumes_at_the_runs_step_and_lr_and_the_model_exports(cli, tmp_path, state_dir):
    hit, results = killed_and_relaunched(spec(tmp_path), state_dir, tmp_path, seed=5)
    run_id = hit["run_id"]
    relaunched = next(r for r in results if r["rank"] == hit["rank"])
    start_step = relaunched["started_at"]
    assert 0 < start_step < STEPS and start_step % H == 0, relaunched  # at a round of the run, not at 0
    assert relaunched["first_lr"] == pytest.approx(lr_after(start_step), rel=1e-6)
    assert relaunched["global_step"] == STEPS
    assert next(r for r in results if r["rank"] != hit["rank"])["started_at"] == 0

    export = cli("export", run_id, "--out", str(tmp_path / "model"))
    assert export.returncode == 0, export.stderr
    assert f"theta digest {results[0]['theta_digest']}" in export.stdout
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "model" / "model.safetensors")
    assert "embed.weight" in weights and sum(w.numel() for w in weights.values()) == results[0]["parameters"]


@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_lightning_replicas_of_two_processes_under_torchrun(cli, tmp_path, state_dir, parallel):
    """Two processes in each replica under torchrun, with Lightning's DDPStrategy or its
    ModelParallelStrategy sharding the module with FSDP2; DiLoCo syncs a lane per process. The
    final validation runs through the Trainer's strategy on every replica: the same loss."""
    path = tmp_path / "diloco.toml"
    text = open(spec(tmp_path, steps=40)).read().replace("replicas = 2\n", "replicas = 2\nprocesses_per_replica = 2\n")
    path.write_text(text.replace("val_every = 0\n", f'val_every = 0\nparallel = "{parallel}"\n'))
    proc = cli("run", str(path), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "round 4  members [0, 1]" in proc.stdout
    record = record_of(state_dir, proc.stdout.split()[1].rstrip(":"))
    one_global_model(record)
    results = [r["result"] for r in record["ranks"]]
    assert [r["started_at"] for r in results] == [0, 0] and len({r["eval_loss"] for r in results}) == 1
