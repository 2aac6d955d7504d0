"""What a warm template imports before it forks replicas (`diloco.local.warmstart`).

The replica runtime and what every replica's first steps import anyway: torch, and
torch._dynamo, which torch's optimizers import at their first `step()` (torch/optim/optimizer.py)
whatever the optimizer — about as long as torch itself. Nothing here may read a variable that
differs between replicas (`diloco.local.warmstart.PER_REPLICA`), start a thread, or initialise CUDA: a
forked child cannot use its parent's CUDA context, so a template that finds one refuses to fork.
"""

from __future__ import annotations

import os

import numpy
import torch
import torch._dynamo  # noqa: F401 - what torch.optim's first step imports

from .loop import diloco  # noqa: F401 - the runtime: DiLoCo and its exchange

if torch.cuda.is_initialized():
    raise RuntimeError("CUDA was initialised while preloading: replicas must start fresh")


_TEMPLATE = os.getpid()  # the process that imports this module is the template


def _fresh_numpy_seed() -> None:
    """numpy's legacy global generator is seeded from OS entropy at import: a fresh replica gets
    its own stream, so a replica forked from the template gets one too (Python's `random`
    reseeds itself at fork). Only the template's own children: what a replica forks itself
    (DataLoader workers) keeps the replica's state, as it would from a fresh replica."""
    if os.getppid() == _TEMPLATE:
        numpy.random.seed()


os.register_at_fork(after_in_child=_fresh_numpy_seed)
