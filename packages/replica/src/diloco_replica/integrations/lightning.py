"""DiLoCo inside ``lightning.Trainer``: a callback added to the Trainer you already have.

    trainer = L.Trainer(max_steps=..., callbacks=[DiLoCoCallback(ctx)])
    trainer.fit(module, datamodule)

A callback, not a Strategy: the Trainer keeps its own strategy (single device; under torchrun
with `processes_per_replica > 1`, DDP or ModelParallelStrategy with FSDP2's ``fully_shard`` in
``configure_model``), its optimizer and LR schedulers, gradient
accumulation, precision plugins, clipping, logging and validation, and DiLoCo's outer loop needs
only to act *after* an optimizer step, which ``on_train_batch_end`` sees (the step counter moved).
A Strategy would own the optimizer step and the process group too, and stand in the way of the
DDP or single-device strategy the user picked. Every H optimizer steps (or `round_seconds`) a
round runs, in any sync mode, exactly as `DiLoCo.step()` in a hand-written loop, because it is
that call.

- **Joining** happens in ``on_fit_start``, once the strategy has placed the module on its device
  and built the optimizer: the module then holds θ_global, the run's global step G is known, and
  the optimizer is the inner one (one optimizer; manual optimization is not supported).
- **A relaunched replica resumes at G**: in ``on_train_start`` the Trainer's step counter
  (``trainer.global_step``, which ``max_steps`` and logging read) is set to G and every LR
  scheduler stepped per optimizer step is moved to G. Lightning restarts the epoch's data
  after a resume unless the loader's state is checkpointed (its own mid-epoch resume does the
  same), so each replica and each restart draws its own shuffle order (below) rather than
  re-reading what it read before it died. The inner optimizer starts afresh, as with the wrapper.
- **A replica that fell behind and caught up** jumps to the run's step: the counter and the
  schedules follow.
- **Loss and tokens**: the training step's loss (averaged over an accumulation window) and the
  batch's first tensor's elements (``input_ids`` of a dict batch), or `tokens_of(batch)`; the
  validation metric `eval_metric` (default ``val_loss``) after each validation. The Trainer's own
  logging is untouched.
- **Data per replica**: unless `per_replica_data` is False (the datasets are sharded by
  ``ctx.rank`` already), torch's global generator — which a shuffling DataLoader without a
  generator of its own draws each epoch's order from — is seeded per replica and global step
  before training starts: ``data_seed`` (default: the process's ``torch.initial_seed()``) +
  rank, + 100,003 × G after a relaunch.
- **At the end** the module holds θ_global (the round in flight merged), the run's last round is
  checkpointed in the store (``diloco export`` from any shell), `theta_digest` is set, and
  replica 0 saves the module's weights to ``<default_root_dir>/diloco-final/model.safetensors``
  (an FSDP2-sharded module gathered by the replica's processes first).

Not supported: Lightning's FSDPStrategy (FSDP1's flat parameters) and DeepSpeedStrategy
(training stops with one line naming ModelParallelStrategy + ``fully_shard`` instead).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy
except ImportError:  # one line, naming the fix
    raise ImportError('diloco_replica.integrations.lightning needs lightning: pip install "diloco-replica[lightning]"'
                      ) from None

from diloco.bootstrap.context import ReplicaContext
from diloco.errors import UserError

from ..loop.diloco import DiLoCo

FINAL_DIR = "diloco-final"  # under the Trainer's default_root_dir: replica 0's final global model
SEED_STRIDE = 100_003       # a relaunch at global step G draws from seed + SEED_STRIDE · G
UNSUPPORTED = (FSDPStrategy, DeepSpeedStrategy)  # FSDP1's flat parameters, DeepSpeed's engine


class DiLoCoCallback(pl.Callback):
    """DiLoCo for the Trainer it is given to (one ``fit()`` per callback)."""

    def __init__(self, ctx: ReplicaContext | None = None, *, per_replica_data: bool = True,
                 data_seed: int | None = None, eval_metric: str = "val_loss",
                 tokens_of: Callable[[Any], int] | None = None, save_final: bool = True, store: Any = None,
                 **settings: Any):
        self.ctx = ctx or ReplicaContext.from_env()
        self.per_replica_data, self.data_seed, self.eval_metric = per_replica_data, data_seed, eval_metric
        self.tokens_of = tokens_of or first_tensor_elements
        self.save_final, self._store, self._settings = save_final, store, settings
        self.diloco: DiLoCo | None = None
        self.theta_digest: str | None = None  # θ_global's digest after training (the same on every replica)
        self.started_at: int | None = None    # the global step this replica's training began at
        self._losses: list[torch.Tensor] = []
        self._tokens = 0
        self._seen_step = 0
        self._closed = False

    # -- the Trainer's events ----------------------------------------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if isinstance(trainer.strategy, UNSUPPORTED):
            raise UserError(f"DiLoCoCallback does not support Lightning's {type(trainer.strategy).__name__}; for a "
                            f"sharded model use ModelParallelStrategy with fully_shard (FSDP2) in configure_model "
                            f"(docs/trainers.md#lightning)")
        if not pl_module.automatic_optimization or len(trainer.optimizers) != 1:
            raise UserError("DiLoCoCallback needs automatic optimization with one optimizer (Lightning's own "
                            "optimizer step, which it follows); this module "
                            + ("sets automatic_optimization = False" if not pl_module.automatic_optimization else
                               f"has {len(trainer.optimizers)} optimizers"))
        self.diloco = DiLoCo(pl_module, trainer.optimizers[0], self.ctx, store=self._store, **self._settings)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        d = self.diloco
        if trainer.global_step > d.global_step:
            raise UserError(f"the Trainer resumed at step {trainer.global_step} (fit(ckpt_path=...)), past run "
                            f"{self.ctx.run_id!r}'s global step {d.global_step}: DiLoCo's state is in the run's "
                            f"store; call fit() without ckpt_path")
        self.move_trainer_to(trainer, d.global_step)
        if self.per_replica_data:
            base = self.data_seed if self.data_seed is not None else torch.initial_seed()
            torch.manual_seed(replica_seed(base, self.ctx.rank, d.global_step))
        max_steps = trainer.max_steps if trainer.max_steps is not None and trainer.max_steps >= 0 else None
        total = d.begin(max_steps)
        self.started_at = self._seen_step = d.global_step
        self.ctx.log.info("DiLoCo in lightning.Trainer: starting at global step %d of %d (round %d), H = %d",
                          d.global_step, total, d.round, d.H)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self._losses.append(loss.detach())  # divided by the accumulation window by Lightning: summed below
        self._tokens += self.tokens_of(batch)
        if trainer.global_step == self._seen_step:
            return  # a micro-batch of an accumulation window: no optimizer step yet
        d = self.diloco
        loss_value = torch.stack(self._losses).float().sum().item() if self._losses else None
        tokens, self._losses, self._tokens = self._tokens, [], 0
        d.step(loss=loss_value, tokens=tokens)
        if d.global_step > trainer.global_step:  # caught up with the run: the counter and the schedules follow
            self.move_trainer_to(trainer, d.global_step)
        self._seen_step = trainer.global_step
        if d.left:  # the run was scaled down without this replica
            trainer.should_stop = True

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        value = trainer.callback_metrics.get(self.eval_metric)
        if self.diloco is not None and not trainer.sanity_checking and value is not None:
            self.diloco.report_eval(float(value))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        try:
            self.diloco.end()
            self.theta_digest = self.diloco.theta_digest()
            if self.save_final and self.ctx.rank == 0:  # every process of replica 0: a sharded module's gather
                self._save(Path(trainer.default_root_dir) / FINAL_DIR, pl_module)
        finally:
            self.close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.close()

    # -- the rest ----------------------------------------------------------------------------

    def close(self) -> None:
        """Leave the run (``on_train_end`` and ``on_exception`` do)."""
        if self.diloco is not None and not self._closed:
            self._closed = True
            self.diloco.close()

    @staticmethod
    def move_trainer_to(trainer: pl.Trainer, step: int) -> None:
        """The Trainer's optimizer-step counter to `step`, and every schedule stepped per optimizer
        step moved as many steps on (each every `frequency` of them)."""
        moved = step - trainer.global_step
        if moved <= 0:
            return
        counter = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total
        counter.ready = counter.completed = step
        for config in trainer.lr_scheduler_configs:
            if config.interval == "step" and not config.reduce_on_plateau:
                after, before = step // config.frequency, (step - moved) // config.frequency
                _advance(config.scheduler, after - before)

    def _save(self, folder: Path, pl_module: pl.LightningModule) -> None:
        """The module's weights as safetensors (process 0 of the replica writes; a module sharded
        with FSDP2 is gathered first, by every process of it)."""
        from safetensors.torch import save_file, save_model
        from torch.distributed.tensor import DTensor

        state = pl_module.state_dict()
        sharded = any(isinstance(v, DTensor) for v in state.values())
        if sharded:
            state = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().contiguous()
                     for k, v in state.items()}
        if self.ctx.lane != 0:
            return
        folder.mkdir(parents=True, exist_ok=True)
        if sharded:
            save_file(state, str(folder / "model.safetensors"))
        else:  # save_model keeps one copy of tied weights
            save_model(pl_module, str(folder / "model.safetensors"))
        self.ctx.log.info("the final global model (theta digest %s) is in %s", self.theta_digest, folder)


def replica_seed(base: int, rank: int, step: int) -> int:
    """The seed of torch's generator for replica `rank` starting at global step `step`."""
    return (base + rank + SEED_STRIDE * step) % (1 << 63)


def first_tensor_elements(batch: Any) -> int:
    """Tokens in a batch, by default: ``input_ids``' elements in a dict batch, else the first
    tensor's (an LM's (batch, context) inputs); 0 when there is none."""
    if isinstance(batch, dict):
        first = batch.get("input_ids", next((v for v in batch.values() if isinstance(v, torch.Tensor)), None))
    elif isinstance(batch, (list, tuple)):
        first = next((v for v in batch if isinstance(v, torch.Tensor)), None)
    else:
        first = batch
    return first.numel() if isinstance(first, torch.Tensor) else 0


def _advance(scheduler: Any, steps: int) -> None:
    """Step an LR schedule `steps` times without an optimizer step."""
    if steps <= 0:
        return
    with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": on purpose here
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(steps):
            scheduler.step()
