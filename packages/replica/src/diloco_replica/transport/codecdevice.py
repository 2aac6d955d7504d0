"""Where a round's codec arithmetic runs: on the model's GPU, or on the host (`codec_device`).

With a quantised transport (bf16, fp16, int8, int4) a round's elementwise work is the codec's:
Δ + the error-feedback residual quantised and decoded again piece by piece (`feedback`), each
member's contribution decoded and folded into the shard's total, the mean taken and encoded
(`reduce`). On the host that work grows with the model and competes with the training loop for
its cores: at 1.0B parameters an int4 round's reduce phase took 4.5 s on 16 host cores, more than
fp32's, so compression stopped paying where it should pay most (docs/benchmarks.md). The GPU
does the same operations in milliseconds; the host then only moves the encoded bytes (an
eighth of fp32's for int4) to and from the device and checks checksums.

With `codec_device = "model"` and the model on a GPU, that work runs there: the
residual lives on the GPU (one fp32 value per parameter of the lane: its GPU-memory cost), the
store's payloads are decoded there, the fold and the mean are taken there, and the encodings come
back to the host as bytes. It runs on a CUDA stream of its own (`running`), so the training loop's
kernels never queue behind it and a copy to the host waits only for the round's own work. Its
bytes are the host's: every operation is one exactly rounded step on either device (`codecs`),
so a GPU replica and a CPU replica in one run hold the same θ_global (tests/test_codec_device.py).
Replicas agree whichever device reduced (every replica, the reducer too, decodes the published
mean on the host), so what the same bytes buy is a run whose result does not depend on where
its arithmetic ran. The default stays "host" until a GPU has run the `cuda` tests and
bench/gpu_sync.py's "device-codec" rows (scripts/gpu-check).

What stays on the host: fp32 (its decode is a view of the payload and its fold one add per
contribution: moving it to the GPU and back would cost more host memory traffic than it saves),
topk (its sparsification keeps its own residual inside the upload), the decoding of the reduced
means that the outer step reads (θ_global and the momentum are on the host), and a round in a
sync process (`exchange = "process"`), which holds no CUDA context.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

ON_DEVICE = ("bf16", "fp16", "int8", "int4")  # the transports whose arithmetic may move to the GPU
HOST = torch.device("cpu")


def placement(setting: str, model_device: torch.device | str | None, transport: str) -> torch.device:
    """Where `codec_device` = `setting` ("model" or "host") puts the codec arithmetic of a round with
    `transport`, for a model on `model_device` (None: not in this process, as in a sync process):
    the model's GPU where the setting, the device and the transport all allow it, else the host."""
    device = torch.device(model_device) if model_device is not None else HOST
    if setting == "model" and device.type == "cuda" and transport in ON_DEVICE:
        return device
    return HOST


class CodecDevice:
    """The device a round's codec arithmetic runs on, and the stream it runs in there."""

    def __init__(self, device: torch.device | str = HOST):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @classmethod
    def choose(cls, setting: str, model_device: torch.device | str | None, transport: str) -> CodecDevice:
        """The `placement` of a round's codec arithmetic, with its stream."""
        return cls(placement(setting, model_device, transport))

    @property
    def on_host(self) -> bool:
        return self.stream is None

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Run the block's device work on this round's stream (the stream is the calling thread's
        for the block only; every round thread enters it around its own work)."""
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            yield

    def to(self, x: torch.Tensor) -> torch.Tensor:
        """`x` where the arithmetic runs (no copy when it is there already)."""
        return x.to(self.device)

    def zeros(self, numel: int) -> torch.Tensor:
        """A zeroed fp32 vector there, ready on this round's stream."""
        with self.running():
            return torch.zeros(numel, dtype=torch.float32, device=self.device)

    def __repr__(self) -> str:
        return f"CodecDevice({str(self.device)!r})"
