"""The training process's part of a round: copies between the model and the shared host buffers.

At a round boundary the training loop does device work only: the round's fragment of its lane is
gathered into one flat fp32 vector on the model's device (a device copy), and that is copied into
the snapshot buffer the sync process reads (`sharedbuf`; registered with CUDA, so the copy is
DMA). A model on the host in a synchronous round is copied tensor by tensor straight into the
buffer instead (the flat vector would be one more copy of it in host memory). When the round is done, its fragment of θ_global is copied back to the device and merged
there: θ_global's fragment as it is (synchronous rounds), or, with overlap, on top of the progress
made since the snapshot, θ_local_now + θ_global_new − θ_local_at_sync, so the next Δ counts every
inner step once. Every operation is a separate elementwise add or subtract, each rounded on its
own, so the merge gives the same floats on any device.

The one wait at a boundary is the snapshot's copy to the host (a few ms for a 100M-parameter
model on a current GPU): the sync process must not read the buffer before it is whole.
"""

from __future__ import annotations

import torch

from . import sharedbuf
from .modelview import ModelView


class Transfers:
    def __init__(self, view: ModelView, theta: torch.Tensor, snapshot: torch.Tensor):
        self.view, self.theta, self.snapshot_buf = view, theta, snapshot
        self.cuda = view.device.type == "cuda"
        self.pinned = self.cuda and sharedbuf.pin(theta) and sharedbuf.pin(snapshot)

    def initial(self) -> None:
        """The lane's parameters into the snapshot buffer: θ_0 if the run turns out to be new."""
        self.snapshot(0, 1, keep=False)

    def snapshot(self, part: int, parts: int, *, keep: bool) -> torch.Tensor | None:
        """Fragment `part` of `parts` into the snapshot buffer; with `keep`, also returned (on the
        model's device) for the merge of an overlapped round. A model on the host is copied
        tensor by tensor straight into the buffer when nothing is kept (no flat copy between)."""
        a, b = self.view.fragment(part, parts)
        if not keep and self.view.device.type == "cpu":
            self.view.copy_part_into(part, parts, self.snapshot_buf[a:b])
            return None
        local = self.view.gather_part(part, parts)
        self._to_host(local, a, b)
        return local if keep else None

    def merge(self, part: int, parts: int, local_at_sync: torch.Tensor | None) -> None:
        """Fragment `part` of θ_global into the model (with overlap: on top of the progress since
        `local_at_sync`)."""
        a, b = self.view.fragment(part, parts)
        new = self.theta[a:b].to(self.view.device, non_blocking=self.pinned)
        if local_at_sync is not None:
            now = self.view.gather_part(part, parts)
            now += new
            now -= local_at_sync
            new = now
        self.view.write_part(new, part, parts)

    def _to_host(self, values: torch.Tensor, a: int, b: int) -> None:
        self.snapshot_buf[a:b].copy_(values, non_blocking=self.pinned)
        if self.cuda:
            torch.cuda.current_stream(values.device).synchronize()  # whole before the sync process reads it
