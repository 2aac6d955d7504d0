"""A relaunched replica's place in the run, as a checkpoint directory ``transformers.Trainer`` resumes from.

The Trainer decides where its training starts — its step counter, the epoch, how many batches of
the epoch to skip, so the data picks up where this replica's left off — inside ``train()``, from
``resume_from_checkpoint`` alone, before any callback runs. A replica that rejoins a run at global
step G hands it a directory of what a Trainer checkpoint at G holds and nothing more:

- ``trainer_state.json``: global step G and the arguments the Trainer compares (logging, eval
  and save steps, the batch size), so it resumes without warnings;
- ``model.safetensors``: the model as it is after the join, θ_global, which the Trainer loads
  back unchanged (it refuses a checkpoint without weights).

No optimizer or scheduler state: the inner optimizer starts afresh on a relaunch (as with the
wrapper: its state is local and was lost with the process), and the callback moves the learning
rate schedule to G itself (`integrations.transformers`). No RNG state: the Trainer goes on
without it. The directory is private to the process (``mkdtemp``) and removed once training has
begun.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch


def write_resume_dir(model: torch.nn.Module, args: Any, global_step: int) -> str:
    """A directory ``Trainer.train(resume_from_checkpoint=...)`` resumes at `global_step` from."""
    from safetensors.torch import save_file
    from transformers import TrainerState

    folder = Path(tempfile.mkdtemp(prefix="diloco-resume-"))
    state = TrainerState(global_step=global_step, logging_steps=args.logging_steps, eval_steps=args.eval_steps,
                         save_steps=args.save_steps, train_batch_size=args.train_batch_size)
    state.save_to_json(str(folder / "trainer_state.json"))
    save_file(_weights(model), str(folder / "model.safetensors"), metadata={"format": "pt"})
    return str(folder)


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict on the host, a tensor tied to one already named (shared embeddings)
    stored again under its own name: the Trainer loads every key it expects, and safetensors
    refuses two names on one buffer."""
    seen: set[int] = set()
    out = {}
    for name, tensor in model.state_dict().items():
        t = tensor.detach()
        storage = t.untyped_storage().data_ptr()
        out[name] = t.to("cpu", copy=storage in seen).contiguous()
        seen.add(storage)
    return out
