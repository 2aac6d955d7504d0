"""Host buffers two processes map at once: how Δ and θ_global cross to and from the sync process.

The training process and its sync process (`syncproc`) share two fp32 vectors of the lane's
size: the local snapshot a round is computed from (the sync process turns it into Δ and then the
mean, in place) and θ_global (the sync process keeps it; the training process copies from it
into the model). Each is a file in /dev/shm mapped MAP_SHARED by both (`torch.from_file(shared=
True)`), unlinked as soon as both have mapped it, so nothing is left behind whichever of them
dies, SIGKILL included. No bytes are serialised: a round moves through the mapping.

When the model is on CUDA the training process registers the mapping with the driver
(`cudaHostRegister`), so copies between it and the device are DMA on a side stream, as from
`pin_memory=True` buffers, and never wait on the interpreter.
"""

from __future__ import annotations

import os
import tempfile
import uuid

import torch

SHM_DIR = "/dev/shm"


def shm_dir() -> str:
    """Where the buffers' files go: /dev/shm (memory), or the temp dir where there is none."""
    return SHM_DIR if os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK) else tempfile.gettempdir()


def create(numel: int, tag: str) -> tuple[str, torch.Tensor]:
    """A new zero-filled shared fp32 vector of `numel` elements: (its path, the tensor)."""
    path = os.path.join(shm_dir(), f"diloco-{tag}-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, max(1, numel) * 4)
    finally:
        os.close(fd)
    return path, attach(path, numel)


def attach(path: str, numel: int) -> torch.Tensor:
    """Map the vector another process created (its size must be `numel` fp32 elements)."""
    size = os.path.getsize(path)
    if size != max(1, numel) * 4:
        raise ValueError(f"shared buffer {path} holds {size} bytes, not {numel} fp32 elements")
    return torch.from_file(path, shared=True, size=max(1, numel), dtype=torch.float32)[:numel]


def unlink(path: str) -> None:
    """Remove the name; the mapping lives on in every process that holds it."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def pin(t: torch.Tensor) -> bool:
    """Register `t`'s memory with CUDA (page-locked: async DMA copies); False where no CUDA is."""
    if not torch.cuda.is_available() or t.numel() == 0:
        return False
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    return int(err) == 0

