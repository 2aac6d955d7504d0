"""DiLoCo inside ``transformers.Trainer``: a callback added to the Trainer you already have.

    callback = DiLoCoCallback(ctx)                                # joins the run when the Trainer is built
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[callback])
    trainer.train(resume_from_checkpoint=callback.resume)         # None, or where this replica rejoins

The Trainer keeps everything it owns — its optimizer and LR scheduler, gradient accumulation,
bf16/fp16, clipping, logging, evaluation, torchrun's DDP — and the callback adds the outer
loop: every H optimizer steps (or `round_seconds`) a round, in any sync mode (overlap,
fragments, transports), exactly as `DiLoCo.step()` in a hand-written loop, because it is that
call, made from ``on_step_end`` (after the optimizer and scheduler stepped).

Why a callback can do it, and what it cannot do alone:
- **Joining** happens in ``on_init_end``, when the Trainer has placed the model on its device:
  the model then holds θ_global and the callback knows the run's global step G.
- **A relaunched replica resumes at G** — the Trainer's step counter, epoch and place in the
  data, which ``train()`` decides from ``resume_from_checkpoint`` before any callback runs. So
  `resume` is a checkpoint directory of the run's state at G (`integrations.resume`), and
  ``on_train_begin`` moves the LR schedule to step G (the scheduler state itself was lost with
  the process; the inner optimizer starts afresh, as with the wrapper). Called without it where
  G > 0, training stops at once with one line saying so.
- **A replica that fell behind and caught up** jumps to the run's step: the Trainer's counter
  and the LR schedule follow; its data goes on from where it was.
- **Loss and tokens** come from a forward hook on the model (the loss the model returns, each
  micro-batch's, averaged per optimizer step; ``input_ids``' size), eval loss from
  ``on_evaluate``: the live bar, timeline and TensorBoard show them; the Trainer's own logs are
  untouched.
- **Data per replica**: replicas must not read the same batches. Unless `per_replica_data` is
  False (the dataset is sharded by ``ctx.rank`` already), the Trainer's data seed becomes
  ``(data_seed or seed) + ctx.rank``: replica 0 reads what a plain Trainer reads.
- **At the end** the model holds θ_global (the round in flight merged), the run's last round is
  checkpointed in the store, `theta_digest` is set, and replica 0 saves the model (and the
  processing class) to ``<output_dir>/diloco-final`` for ``from_pretrained``. The model's config
  is in the run's store too (`modelconfig`), so ``diloco export`` gives a loadable directory
  from any shell, also when the replicas' disks are gone.

Not supported yet: FSDP or DeepSpeed through the Trainer, which replace the model's parameters
after the callback joined (training stops with one line; FSDP2 works through the wrapper).
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

try:
    from transformers import TrainerCallback
except ImportError:  # one line, naming the fix
    raise ImportError('diloco_replica.integrations.transformers needs transformers and accelerate: '
                      'pip install "diloco-replica[transformers]"') from None

from diloco.bootstrap.context import ReplicaContext
from diloco.errors import UserError
from diloco.store.runkeys import RunKeys

from ..loop.diloco import DiLoCo
from ..outer.modelconfig import publish as publish_config
from .resume import write_resume_dir

FINAL_DIR = "diloco-final"  # under the Trainer's output_dir: replica 0's final global model


class DiLoCoCallback(TrainerCallback):
    """DiLoCo for the Trainer it is given to (one ``train()`` per callback)."""

    def __init__(self, ctx: ReplicaContext | None = None, *, per_replica_data: bool = True, save_final: bool = True,
                 store: Any = None, **settings: Any):
        self.ctx = ctx or ReplicaContext.from_env()
        self.per_replica_data, self.save_final = per_replica_data, save_final
        self._store, self._settings = store, settings
        self.diloco: DiLoCo | None = None
        self.resume: str | None = None       # for train(resume_from_checkpoint=...): None on a new run
        self.theta_digest: str | None = None  # θ_global's digest after training (the same on every replica)
        self.started_at: int | None = None    # the global step this replica's training began at
        self._data_seed: int | None = None
        self._params: list[int] = []
        self._hook: Any = None
        self._losses: list[torch.Tensor] = []
        self._tokens = 0
        self._closed = False

    # -- the Trainer's events ----------------------------------------------------------------

    def on_init_end(self, args, state, control, model=None, **kwargs):
        if self.per_replica_data:
            if self._data_seed is None:
                self._data_seed = (args.data_seed if args.data_seed is not None else args.seed) + self.ctx.rank
            args.data_seed = self._data_seed
        self._join(model)
        if self.diloco.global_step > 0:
            self.resume = write_resume_dir(model, args, self.diloco.global_step)
        return control

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        try:
            self._begin(state, model, optimizer, lr_scheduler)
        except BaseException:
            self.close()  # the Trainer calls no on_train_end after this: leave the run here
            raise
        return control

    def _begin(self, state, model, optimizer, lr_scheduler) -> None:
        joined_late = self.diloco is None
        if joined_late:  # added with trainer.add_callback: a new run can still start here
            self._join(model)
        d = self.diloco
        if state.global_step != d.global_step:
            how = ("build the Trainer with callbacks=[callback] and call " if joined_late else "call ")
            raise UserError(f"this replica joins run {self.ctx.run_id!r} at global step {d.global_step}, but the "
                            f"Trainer starts at step {state.global_step}: {how}trainer.train(resume_from_checkpoint="
                            f"callback.resume)")
        if [id(p) for p in _trainable(model)] != self._params:
            raise UserError("the Trainer replaced the model's parameters after DiLoCo joined (FSDP or DeepSpeed "
                            "through the Trainer), which DiLoCoCallback does not support yet; train FSDP2 models "
                            "with the DiLoCo wrapper (docs/sync-modes.md)")
        if self.resume is not None:
            shutil.rmtree(self.resume, ignore_errors=True)  # read by now; nothing the Trainer reads later is in it
        d.inner_opt = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds the torch one
        _advance(lr_scheduler, d.global_step - int(getattr(lr_scheduler, "last_epoch", d.global_step)))
        total = d.begin(state.max_steps)
        self.started_at = d.global_step
        self.ctx.log.info("DiLoCo in transformers.Trainer: starting at global step %d of %d (round %d), H = %d",
                          d.global_step, total, d.round, d.H)

    def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):
        d = self.diloco
        loss = torch.stack(self._losses).float().mean().item() if self._losses else None
        tokens, self._losses, self._tokens = self._tokens, [], 0
        d.step(loss=loss, tokens=tokens)
        if d.global_step > state.global_step:  # caught up with the run: the counter and the schedule follow
            _advance(lr_scheduler, d.global_step - state.global_step)
            state.global_step = d.global_step
        if d.left:  # the run was scaled down without this replica
            control.should_training_stop = True
        return control

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if self.diloco is not None and metrics and "eval_loss" in metrics:
            self.diloco.report_eval(float(metrics["eval_loss"]))
        return control

    def on_train_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        try:
            self.diloco.end()
            self.theta_digest = self.diloco.theta_digest()
            if self.save_final and self.ctx.rank == 0 and self.ctx.lane == 0:
                self._save(Path(args.output_dir) / FINAL_DIR, model, processing_class)
        finally:
            self.close()
        return control

    # -- the rest ----------------------------------------------------------------------------

    def close(self) -> None:
        """Leave the run (``on_train_end`` does; a training that raised should too)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.diloco is not None and not self._closed:
            self._closed = True
            self.diloco.close()
        if self.resume is not None:
            shutil.rmtree(self.resume, ignore_errors=True)

    def _join(self, model: torch.nn.Module | None) -> None:
        if model is None:
            raise UserError("DiLoCoCallback needs the Trainer's model: build the Trainer with model=...")
        self.diloco = d = DiLoCo(model, None, self.ctx, store=self._store, **self._settings)
        self._params = [id(p) for p in _trainable(model)]
        self._hook = model.register_forward_hook(self._on_forward, with_kwargs=True)
        config = getattr(model, "config", None)
        if hasattr(config, "to_json_string"):  # so `diloco export` writes a directory from_pretrained loads
            data = json.loads(config.to_json_string(use_diff=False))
            d.lanes.on_leader(lambda: publish_config(d.store, RunKeys(self.ctx.run_id), data))

    def _on_forward(self, module, args, kwargs, output) -> None:
        """A training forward's loss (kept on its device until the step ends) and tokens."""
        if not module.training:
            return
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self._losses.append(loss.detach())
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, torch.Tensor):
            self._tokens += ids.numel()

    def _save(self, folder: Path, model: Any, processing_class: Any) -> None:
        """The final global model where ``from_pretrained`` loads it."""
        if hasattr(model, "save_pretrained"):
            model.save_pretrained(folder)
        else:
            from safetensors.torch import save_model

            folder.mkdir(parents=True, exist_ok=True)
            save_model(model, str(folder / "model.safetensors"))
        if hasattr(processing_class, "save_pretrained"):
            processing_class.save_pretrained(folder)
        self.ctx.log.info("the final global model (theta digest %s) is in %s", self.theta_digest, folder)


def _trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _advance(scheduler: Any, steps: int) -> None:
    """Step the LR schedule `steps` times without an optimizer step (a schedule driven by
    metrics, ReduceLROnPlateau, has no position to move)."""
    if scheduler is None or steps <= 0 or isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return
    with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": on purpose here
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(steps):
            scheduler.step()
