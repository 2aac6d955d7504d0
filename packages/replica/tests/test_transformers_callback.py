"""`DiLoCoCallback` in a real ``transformers.Trainer``: it does what the hand-written loop does, a
relaunched replica resumes at the run's global step with the learning rate and the data there,
replicas read different data, the final model comes out loadable, and misuse stops in one line.
(N replicas bit-identical and a SIGKILLed replica relaunched by the launcher: tests/test_hf_trainer.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from diloco.bootstrap.context import ReplicaContext  # noqa: E402
from diloco.errors import UserError  # noqa: E402
from diloco.store.objectstore import open_store  # noqa: E402
from diloco_replica import DiLoCo  # noqa: E402
from diloco_replica.export import export  # noqa: E402
from diloco_replica.integrations.transformers import DiLoCoCallback  # noqa: E402

from trainer_jobs import Probe, arguments, tiny_llama, trainer, windows  # noqa: E402

H = 5


def memory_store():
    return open_store(f"memory://{uuid.uuid4().hex}")


class CrashAt:
    """A replica that dies after optimizer step `step` (no on_train_end: what a kill leaves)."""

    def __init__(self, step: int):
        self.step = step

    def __getattr__(self, event):  # every other event of TrainerCallback: nothing to do
        return lambda args, state, control, **kw: control

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise RuntimeError("killed")
        return control


MODES = {"rounds": {}, "overlap": {"overlap": True, "overlap_delay": 2}, "fragments": {"fragments": 5},
         "int4": {"transport": "int4"}, "round_seconds": {"round_seconds": 3600.0}}  # (closing at H steps: repeatable)


@pytest.mark.parametrize("mode", MODES)
def test_the_callback_does_what_the_hand_written_loop_does(tmp_path, mode):
    """Two rounds' steps through the Trainer, then the same model, optimizer, schedule, clipping
    and batches through `DiLoCo.step()` by hand, in each sync mode (overlap merged at a fixed
    delay, so both runs merge at the same step): the same round losses and tokens, the same
    θ_global."""
    data, probe, settings = windows(), Probe(), MODES[mode]
    callback = DiLoCoCallback(ReplicaContext(0, 1, "hf-trainer"), store=memory_store(), sync_every=H, save_final=False,
                              **settings)
    trainer(tiny_llama(), arguments(str(tmp_path / "t"), 2 * H), data, callback, probe).train()

    args = arguments(str(tmp_path / "h"), 2 * H)
    by_hand = trainer(tiny_llama(), args, data)  # only to build the optimizer and schedule the Trainer builds
    by_hand.create_optimizer_and_scheduler(num_training_steps=2 * H)
    model, opt, schedule = by_hand.model, by_hand.optimizer, by_hand.lr_scheduler
    diloco = DiLoCo(model, opt, ReplicaContext(0, 1, "hand"), store=memory_store(), sync_every=H, **settings)
    for _, ids in zip(diloco.steps(2 * H), probe.batches, strict=True):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        opt.step()
        schedule.step()
        model.zero_grad()
        diloco.step(loss=loss.item(), tokens=ids.numel())
    hand_digest = diloco.theta_digest()
    diloco.close()

    rows = lambda metrics: [(m.round, m.loss, m.tokens) for m in metrics]  # noqa: E731
    assert rows(callback.diloco.metrics) == rows(diloco.metrics)
    rounds = 2 * H // (H // diloco.fragments)
    assert [m.round for m in diloco.metrics] == list(range(1, rounds + 1))
    assert sum(m.tokens for m in diloco.metrics) == 2 * H * 4 * 16
    assert callback.theta_digest == hand_digest


def test_accumulation_mixed_precision_and_evaluation_go_through(tmp_path):
    """A round every H optimizer steps (not micro-batches), under bf16 autocast with two
    micro-batches a step; each round's tokens are its micro-batches'; the Trainer's evaluations
    land in the rounds' rows. (In a process of its own: accelerate keeps a Trainer's mixed
    precision for the process's later Accelerators.)"""
    code = f"import json, trainer_jobs; print(json.dumps(trainer_jobs.accumulated_bf16_rows({str(tmp_path)!r}, {H})))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["round"] for r in rows] == [1, 2] and all(r["tokens"] == H * 2 * 4 * 16 for r in rows)
    assert all(r["loss"] is not None and 0 < r["loss"] < 10 for r in rows)
    evals = [e for r in rows for e in r["evals"]]
    assert [step for step, _ in evals] == [H] and evals[0][1] > 0  # the eval at step 2H comes after its round


def test_a_relaunched_replica_resumes_at_the_runs_step_with_its_lr_and_data(tmp_path):
    store, data = memory_store(), windows()
    steps = 4 * H
    first = DiLoCoCallback(ReplicaContext(0, 1, "hf-relaunch"), store=store, sync_every=H)
    assert first.resume is None  # a new run
    with pytest.raises(RuntimeError, match="killed"):
        trainer(tiny_llama(), arguments(str(tmp_path / "o"), steps), data, first, CrashAt(2 * H + 2)).train()
    first.close()  # what the process's end does; rounds 1 and 2 are in the store

    # relaunched with another θ in memory: the run's comes from the store
    relaunched, probe = DiLoCoCallback(ReplicaContext(0, 1, "hf-relaunch", attempt=1), store=store, sync_every=H), Probe()
    t = trainer(tiny_llama(seed=7), arguments(str(tmp_path / "o"), steps), data, relaunched, probe)
    assert relaunched.resume is not None
    with pytest.raises(UserError, match=r"joins run 'hf-relaunch' at global step 10, but the Trainer starts at step 0: "
                                        r"call trainer.train\(resume_from_checkpoint=callback.resume\)"):
        t.train()
    relaunched.close()

    relaunched, probe = DiLoCoCallback(ReplicaContext(0, 1, "hf-relaunch", attempt=2), store=store, sync_every=H), Probe()
    t = trainer(tiny_llama(seed=7), arguments(str(tmp_path / "o"), steps), data, relaunched, probe)
    t.train(resume_from_checkpoint=relaunched.resume)

    # a plain Trainer (the callback's data seed) that was never interrupted: where it was at step 10
    plain_probe = Probe()
    plain = trainer(tiny_llama(), arguments(str(tmp_path / "p"), steps, data_seed=42), data, plain_probe)
    plain.train()
    expected = trainer(tiny_llama(), arguments(str(tmp_path / "s"), steps), data)
    expected.create_optimizer_and_scheduler(num_training_steps=steps)
    with warnings.catch_warnings():  # stepped without an optimizer: on purpose
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(2 * H):
            expected.lr_scheduler.step()
    assert probe.start_step == 2 * H and probe.steps_ended == list(range(2 * H + 1, steps + 1))
    assert probe.start_lr == expected.lr_scheduler.get_last_lr()[0] != plain_probe.start_lr  # not back at step 0
    assert torch.equal(probe.batches[0], plain_probe.batches[2 * H])  # the batches of step 11 on, as uninterrupted
    assert [m.round for m in relaunched.diloco.metrics] == [3, 4]

    # the final model: the store's last round exported with the config, and replica 0's own copy
    out = export(store, "hf-relaunch", tmp_path / "export")
    assert out.round == 4 and out.theta_digest == relaunched.theta_digest and out.config
    from transformers import LlamaForCausalLM

    ids = data[0]["input_ids"][None]
    reference = tiny_llama()  # the trained weights in a plain model (a Trainer's may forward under autocast)
    reference.load_state_dict(t.model.state_dict())
    trained = reference.eval()(input_ids=ids, labels=ids).loss
    for folder in (tmp_path / "export", tmp_path / "o" / "diloco-final"):
        loaded = LlamaForCausalLM.from_pretrained(folder).eval()
        assert all(torch.equal(a, b) for a, b in zip(loaded.parameters(), t.model.parameters(), strict=True))
        assert torch.equal(loaded(input_ids=ids, labels=ids).loss, trained)


def test_replicas_read_different_data_unless_told_the_data_is_sharded(tmp_path):
    store = memory_store()
    for rank, per_replica, seed in [(0, True, 42), (1, True, 43), (1, False, None)]:  # replica 0 makes the run
        callback = DiLoCoCallback(ReplicaContext(rank, 2, "hf-seed"), store=store, sync_every=H,
                                  per_replica_data=per_replica, round_timeout=1)  # replica 1 never comes to round 0
        args = arguments(str(tmp_path), 2 * H)
        trainer(tiny_llama(), args, windows(8), callback)
        assert args.data_seed == seed
        callback.close()


def test_parameters_replaced_after_the_join_stop_training_in_one_line(tmp_path):
    """What FSDP or DeepSpeed through the Trainer do: DiLoCo would sync tensors no longer trained."""
    callback = DiLoCoCallback(ReplicaContext(0, 1, "hf-fsdp"), store=memory_store(), sync_every=H)
    model = tiny_llama()
    t = trainer(model, arguments(str(tmp_path), 2 * H), windows(8), callback)
    model.model.norm.weight = torch.nn.Parameter(model.model.norm.weight.detach().clone())
    with pytest.raises(UserError, match="replaced the model's parameters after DiLoCo joined"):
        t.train()
    callback.close()


def test_without_the_extra_the_import_says_what_to_install():
    code = "import sys; sys.modules['transformers'] = None; import diloco_replica.integrations.transformers"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == ('ImportError: diloco_replica.integrations.transformers needs '
                                                    'transformers and accelerate: pip install "diloco-replica[transformers]"')


def test_an_accelerate_loop_with_the_wrapper_is_the_plain_loop():
    """README's Accelerate paragraph: the loop keeps accelerator.prepare and accelerator.backward,
    DiLoCo wraps the prepared model and optimizer; two rounds give the plain loop's θ_global."""
    from accelerate import Accelerator

    loader = lambda: torch.utils.data.DataLoader(windows(2 * H * 4), batch_size=4)  # noqa: E731
    digests = []
    for accelerated in (False, True):
        model = tiny_llama()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batches = loader()
        if accelerated:
            accelerator = Accelerator(cpu=True)
            model, opt, batches = accelerator.prepare(model, opt, batches)
        diloco = DiLoCo(model, opt, ReplicaContext(0, 1, f"accelerate-{accelerated}"), store=memory_store(),
                        sync_every=H)
        for _, batch in zip(diloco.steps(2 * H), batches, strict=True):
            loss = model(**batch).loss
            accelerator.backward(loss) if accelerated else loss.backward()
            opt.step()
            opt.zero_grad()
            diloco.step(loss=loss.item())
        digests.append(diloco.theta_digest())
        assert diloco.round == 2
        diloco.close()
    assert digests[0] == digests[1]
