"""`DiLoCoCallback` in a real ``lightning.Trainer``: it does what the hand-written loop does, a
relaunched replica resumes at the run's global step with the learning rate there, a replica that
catches up jumps with its schedule, the final model comes out, and misuse stops in one line.
(N replicas bit-identical and a SIGKILLed replica relaunched by the launcher: tests/test_lightning.py.)"""

from __future__ import annotations

import subprocess
import sys
import uuid
import warnings

import pytest
import torch
from torch import nn

L = pytest.importorskip("lightning")

from diloco.bootstrap.context import ReplicaContext  # noqa: E402
from diloco.errors import UserError  # noqa: E402
from diloco.store.objectstore import open_store  # noqa: E402
from diloco_replica import DiLoCo  # noqa: E402
from diloco_replica.export import export  # noqa: E402
from diloco_replica.integrations.lightning import DiLoCoCallback, first_tensor_elements, replica_seed  # noqa: E402

H, BATCH, DIM = 5, 4, 8


def memory_store():
    return open_store(f"memory://{uuid.uuid4().hex}")


class Regression(L.LightningModule):
    """A small MLP on a fixed regression task; AdamW with a warmup schedule stepped per optimizer step."""

    def __init__(self, seed: int = 0, total: int = 4 * H, manual: bool = False):
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(DIM, 32), nn.Tanh(), nn.Linear(32, 1))
        self.total = total
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.training_step(batch, batch_idx))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: schedule_factor(s, self.total))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def schedule_factor(step: int, total: int) -> float:
    return min(1.0, (step + 1) / 4) * (1 - step / (total + 1))


def batches(n: int = 200, seed: int = 1) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, DIM, generator=g)
    return torch.utils.data.TensorDataset(x, x.sum(-1).sin())


class Probe(L.Callback):
    """What the Trainer did: the batches it trained on, its step and learning rate when training began."""

    def __init__(self):
        self.batches, self.start_step, self.start_lr = [], None, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.start_step is None:
            self.start_step, self.start_lr = trainer.global_step, trainer.optimizers[0].param_groups[0]["lr"]
        self.batches.append([t.clone() for t in batch])


class CrashAt(L.Callback):
    """A replica that dies after optimizer step `step` (what a kill leaves: no on_train_end)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            raise RuntimeError("killed")


def trainer(max_steps: int, *callbacks, accumulate: int = 1, root=None, **more) -> L.Trainer:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return L.Trainer(**{"max_steps": max_steps, "accelerator": "cpu", "devices": 1, "logger": False,
                            "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False,
                            "num_sanity_val_steps": 0, "limit_val_batches": 0, "accumulate_grad_batches": accumulate,
                            "callbacks": list(callbacks), "default_root_dir": root, **more})


def fit(t: L.Trainer, module: L.LightningModule, data=None, shuffle: bool = False, val=None) -> None:
    loader = torch.utils.data.DataLoader(data or batches(), batch_size=BATCH, shuffle=shuffle)
    val_loader = torch.utils.data.DataLoader(val, batch_size=BATCH) if val is not None else None
    with warnings.catch_warnings():  # "no validation loop", "num_workers": beside the point
        warnings.simplefilter("ignore")
        t.fit(module, loader, val_loader)


def rows(diloco: DiLoCo) -> list[tuple[int, float, int]]:
    return [(m.round, m.loss, m.tokens) for m in diloco.metrics]


MODES = {"rounds": {}, "overlap": {"overlap": True, "overlap_delay": 2}, "fragments": {"fragments": 5},
         "int4": {"transport": "int4"}, "round_seconds": {"round_seconds": 3600.0}}  # (closing at H steps: repeatable)


@pytest.mark.parametrize("mode", MODES)
def test_the_callback_does_what_the_hand_written_loop_does(tmp_path, mode):
    """Two rounds' steps through the Trainer, then the same module, optimizer, schedule and batches
    through `DiLoCo.step()` by hand, in each sync mode (overlap merged at a fixed delay, so both
    merge at the same step): the same round losses and tokens, the same θ_global."""
    settings, probe = MODES[mode], Probe()
    callback = DiLoCoCallback(ReplicaContext(0, 1, "lightning"), store=memory_store(), sync_every=H,
                              save_final=False, **settings)
    fit(trainer(2 * H, callback, probe), Regression())

    module = Regression()
    config = module.configure_optimizers()
    opt, schedule = config["optimizer"], config["lr_scheduler"]["scheduler"]
    diloco = DiLoCo(module, opt, ReplicaContext(0, 1, "hand"), store=memory_store(), sync_every=H, **settings)
    for i, (_, batch) in enumerate(zip(diloco.steps(2 * H), probe.batches, strict=True)):
        loss = module.training_step(batch, i)
        loss.backward()
        opt.step()
        schedule.step()
        opt.zero_grad()
        diloco.step(loss=loss.item(), tokens=batch[0].numel())
    assert rows(callback.diloco) == rows(diloco) and len(rows(diloco)) == (2 * H // H) * settings.get("fragments", 1)
    assert callback.theta_digest == diloco.theta_digest()
    diloco.close()


def test_accumulated_steps_are_one_inner_step_and_their_loss_the_windows_mean():
    """With accumulate_grad_batches = 2 a round comes every H optimizer steps (2H batches), the
    tokens are every micro-batch's, and a step's loss is the mean of its micro-batches' losses."""
    losses = []

    class Recorded(Regression):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            losses.append(loss.item())
            return loss

    callback = DiLoCoCallback(ReplicaContext(0, 1, "lightning-accumulate"), store=memory_store(), sync_every=H,
                              save_final=False)
    t = trainer(2 * H, callback, accumulate=2)
    fit(t, Recorded())
    assert t.global_step == 2 * H and [m.round for m in callback.diloco.metrics] == [1, 2]
    assert [m.tokens for m in callback.diloco.metrics] == [2 * H * BATCH * DIM] * 2
    assert callback.diloco.metrics[0].loss == pytest.approx(sum(losses[:2 * H]) / (2 * H), rel=1e-5)


def test_bf16_mixed_precision_and_validation_reach_the_rows():
    """precision="bf16-mixed" (autocast on the CPU): rounds every H steps with finite losses; each
    validation's val_loss (the sanity check's left out) goes into the next round's row."""
    callback = DiLoCoCallback(ReplicaContext(0, 1, "lightning-bf16"), store=memory_store(), sync_every=H,
                              save_final=False)
    t = trainer(2 * H, callback, precision="bf16-mixed", limit_val_batches=2, val_check_interval=H,
                num_sanity_val_steps=1)
    fit(t, Regression(), val=batches(16, seed=9))
    rows = callback.diloco.metrics
    assert [m.round for m in rows] == [1, 2] and all(0 < m.loss < 10 for m in rows)
    evals = [e for m in rows for e in m.evals]
    assert [step for step, _ in evals] == [H] and all(0 < loss < 10 for _, loss in evals)


def test_a_relaunched_replica_resumes_at_the_runs_step_with_its_lr():
    store, steps = memory_store(), 4 * H
    first = DiLoCoCallback(ReplicaContext(0, 1, "lightning-relaunch"), store=store, sync_every=H, save_final=False)
    with pytest.raises(RuntimeError, match="killed"):
        fit(trainer(steps, first, CrashAt(2 * H + 2)), Regression(total=steps))
    # on_exception left the run; rounds 1 and 2 are in the store

    # relaunched with another θ in memory: the run's comes from the store
    relaunched, probe = DiLoCoCallback(ReplicaContext(0, 1, "lightning-relaunch", attempt=1), store=store,
                                       sync_every=H, save_final=False), Probe()
    module = Regression(seed=7, total=steps)
    t = trainer(steps, relaunched, probe)
    fit(t, module)
    assert relaunched.started_at == probe.start_step == 2 * H and t.global_step == steps
    assert probe.start_lr == pytest.approx(1e-2 * schedule_factor(2 * H, steps))  # not back at step 0
    assert len(probe.batches) == steps - 2 * H
    assert [m.round for m in relaunched.diloco.metrics] == [3, 4]


def test_the_final_model_is_saved_and_exported_with_the_modules_names(tmp_path):
    from safetensors.torch import load_file

    store = memory_store()
    callback = DiLoCoCallback(ReplicaContext(0, 1, "lightning-final"), store=store, sync_every=H, checkpoint_every=1)
    module = Regression()
    fit(trainer(2 * H, callback, root=str(tmp_path)), module)
    saved = load_file(tmp_path / "diloco-final" / "model.safetensors")
    assert set(saved) == set(module.state_dict()) and all(torch.equal(saved[k], v) for k, v in module.state_dict().items())
    out = export(store, "lightning-final", tmp_path / "export")
    assert out.round == 2 and out.theta_digest == callback.theta_digest
    fresh = Regression(seed=5)  # the exported weights in a new module reproduce the trained one's loss
    fresh.load_state_dict(load_file(tmp_path / "export" / "model.safetensors"))
    x, y = batches(32, seed=3).tensors
    assert fresh.training_step((x, y), 0).item() == module.training_step((x, y), 0).item()


def test_each_replica_shuffles_its_own_data_and_a_relaunch_does_not_replay_the_epochs_start():
    """A shuffling DataLoader draws its order from torch's generator, which the callback seeds with
    `replica_seed`: per replica and, after a relaunch, per global step too."""
    firsts = {}
    for run, seed in [("a", 11), ("b", 11), ("c", 12)]:
        callback = DiLoCoCallback(ReplicaContext(0, 1, run), store=memory_store(), sync_every=H, save_final=False,
                                  data_seed=seed)
        probe = Probe()
        fit(trainer(1, callback, probe), Regression(), shuffle=True)
        firsts[run] = probe.batches[0][0]
    assert torch.equal(firsts["a"], firsts["b"]) and not torch.equal(firsts["a"], firsts["c"])
    assert replica_seed(11, 1, 0) == replica_seed(12, 0, 0)  # so "c" is what rank 1 of "a"'s run reads
    assert replica_seed(11, 0, 2 * H) != replica_seed(11, 0, 0)


def test_a_caught_up_replica_jumps_with_its_schedule():
    """`move_trainer_to`: the Trainer's counter and a per-step schedule (frequency 2) follow a jump."""
    probe = Probe()
    module = Regression(total=100)
    t = trainer(100, probe)

    class Jump(L.Callback):
        def on_train_start(self, trainer, pl_module):
            trainer.lr_scheduler_configs[0].frequency = 2
            DiLoCoCallback.move_trainer_to(trainer, 10)
            trainer.should_stop = True

    t.callbacks.append(Jump())
    fit(t, module)
    schedule = t.lr_scheduler_configs[0].scheduler
    assert t.global_step == 10 and schedule.last_epoch == 5


def test_misuse_stops_in_one_line():
    with pytest.raises(UserError, match="automatic optimization with one optimizer"):
        fit(trainer(H, DiLoCoCallback(ReplicaContext(0, 1, "two"), store=memory_store(), save_final=False)),
            Regression(manual=True))
    from lightning.pytorch.strategies import FSDPStrategy

    class FSDP1:  # what on_fit_start reads of a Trainer on Lightning's FSDPStrategy (it needs a process group to run)
        strategy, optimizers = FSDPStrategy(), []

    callback = DiLoCoCallback(ReplicaContext(0, 1, "fsdp1"), store=memory_store(), save_final=False)
    with pytest.raises(UserError, match="does not support Lightning's FSDPStrategy; for a sharded model use "
                                        "ModelParallelStrategy with fully_shard"):
        callback.on_fit_start(FSDP1(), Regression())


def test_tokens_of_a_batch():
    ids = torch.zeros(3, 7, dtype=torch.long)
    assert first_tensor_elements({"labels": torch.zeros(2), "input_ids": ids}) == 21
    assert first_tensor_elements((ids, ids)) == 21 and first_tensor_elements(ids) == 21
    assert first_tensor_elements(["text"]) == 0


def test_importing_without_the_extra_says_which_extra_in_one_line():
    code = ("import sys; sys.modules['lightning'] = None; sys.modules['lightning.pytorch'] = None\n"
            "import diloco_replica.integrations.lightning")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == ('ImportError: diloco_replica.integrations.lightning needs '
                                                     'lightning: pip install "diloco-replica[lightning]"')
