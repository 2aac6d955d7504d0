"""examples/hf-trainer: `transformers.Trainer` with `DiLoCoCallback`, run as a user runs it, through
the launcher: replicas on one global model after every round while one is SIGKILLed and relaunched
(it resumes at the run's global step, with the learning rate of that step), the model exported
from the store as a directory `from_pretrained` loads, and replicas of two processes under
torchrun (the Trainer's own DDP)."""

from __future__ import annotations

import pytest

from conftest import ROOT, one_global_model, record_of
from fault_harness import killed_and_relaunched

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

EXAMPLE = ROOT / "examples" / "hf-trainer"
STEPS, H, WARMUP, LR = 200, 10, 30, 1e-3


def spec(tmp_path, *, steps: int = STEPS, extra: str = "") -> str:
    """The example's spec, shortened: a smaller Llama, the learning rate logged every step."""
    text = (EXAMPLE / "diloco.toml").read_text()
    for old, new in [("total_steps = 300", f"total_steps = {steps}"), ("sync_every = 50", f"sync_every = {H}"),
                     ("batch_size = 8", "batch_size = 4"), ("seq_len = 128", "seq_len = 32"),
                     ("eval_steps = 100", "eval_steps = 0\nlogging_steps = 1\nhidden = 64\nlayers = 2\nheads = 2\n"
                                          "max_bytes = 300_000"),
                     ("round_timeout = 300", "round_timeout = 30"),
                     ("parameters = 3279104", "parameters = 123456"),
                     ('entrypoint = "train:train"', f'entrypoint = "train:train"\nworkdir = "{EXAMPLE}"')]:
        assert old in text, f"examples/hf-trainer/diloco.toml no longer says {old!r}"
        text = text.replace(old, new)
    path = tmp_path / "diloco.toml"
    path.write_text(text.replace("[restart]\n", "[restart]\nmax_restarts = 4\nbackoff = 0.2\n") + extra)
    return str(path)


def lr_after(steps: int) -> float:
    """The example's schedule (cosine with warmup, as TrainingArguments builds it) after `steps`."""
    import warnings

    import torch
    from transformers import get_cosine_schedule_with_warmup

    schedule = get_cosine_schedule_with_warmup(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR),
                                               WARMUP, STEPS)
    with warnings.catch_warnings():  # the schedule stepped without an optimizer: on purpose
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(steps):
            schedule.step()
    return schedule.get_last_lr()[0]


def test_a_killed_trainer_replica_resumes_at_the_runs_step_and_lr_and_the_model_exports(cli, tmp_path, state_dir):
    hit, results = killed_and_relaunched(spec(tmp_path), state_dir, tmp_path, seed=3)
    run_id = hit["run_id"]
    relaunched = next(r for r in results if r["rank"] == hit["rank"])
    start_step = relaunched["started_at"]
    assert 0 < start_step < STEPS and start_step % H == 0, relaunched  # at a round of the run, not at 0
    assert relaunched["first_logged"] == {"step": start_step + 1, "learning_rate": lr_after(start_step)}
    assert next(r for r in results if r["rank"] != hit["rank"])["started_at"] == 0

    export = cli("export", run_id, "--out", str(tmp_path / "model"))
    assert export.returncode == 0, export.stderr
    assert f"theta digest {results[0]['theta_digest']}" in export.stdout and "from_pretrained" in export.stdout
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tmp_path / "model")
    assert sum(p.numel() for p in model.parameters()) == results[0]["parameters"]


def test_trainer_replicas_of_two_processes_under_torchrun(cli, tmp_path, state_dir):
    """The Trainer's DDP over torchrun's two processes in each replica; DiLoCo syncs a lane per process."""
    path = tmp_path / "diloco.toml"
    path.write_text(open(spec(tmp_path, steps=40)).read().replace("replicas = 2\n", "replicas = 2\nprocesses_per_replica = 2\n"))
    proc = cli("run", str(path), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "round 4  members [0, 1]" in proc.stdout
    record = record_of(state_dir, proc.stdout.split()[1].rstrip(":"))
    one_global_model(record)
    assert [r["result"]["started_at"] for r in record["ranks"]] == [0, 0]
