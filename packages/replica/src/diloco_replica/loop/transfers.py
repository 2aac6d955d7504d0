"""The training process's part of a round: copies between the model and the host buffers.

Where the round runs in a sync process (or the lane's values are FSDP2 shards other processes
hold), the training loop does device work only at a round boundary: the round's fragment of its
lane is gathered into one flat fp32 vector on the model's device (a device copy), and that is
copied into the snapshot buffer the sync process reads (`sharedbuf`; registered with CUDA, so the
copy is DMA). A model on the host in a synchronous round is copied tensor by tensor straight into
the buffer instead (the flat vector would be one more copy of it in host memory).

Where the round runs on a thread of this process, no snapshot is taken: the round reads θ_local a
slice at a time as it needs it (`streaming.LiveDelta`) — from the parameters themselves in a
synchronous round, while the training loop waits for it, or with overlap from the fragment's
device copy kept for the merge — so the host holds no copy of the lane beside θ_global and the
momentum (bench/gpu_sync.py's host memory rows). When the round is done, its fragment of θ_global is copied back to the device and merged
there: θ_global's fragment as it is (synchronous rounds), or, with overlap, on top of the progress
made since the snapshot, θ_local_now + θ_global_new − θ_local_at_sync, so the next Δ counts every
inner step once. Every operation is a separate elementwise add or subtract, each rounded on its
own, so the merge gives the same floats on any device.

The one wait at a boundary is the snapshot's copy to the host (a few ms for a 100M-parameter
model on a current GPU): the sync process must not read the buffer before it is whole.
"""

from __future__ import annotations

import torch

from ..exchange import sharedbuf
from .modelview import ModelView
from ..round.streaming import LocalReader


class Transfers:
    def __init__(self, view: ModelView, theta: torch.Tensor, snapshot: torch.Tensor | None):
        self.view, self.theta, self.snapshot_buf = view, theta, snapshot
        self.cuda = view.device.type == "cuda"
        self.pinned = self.cuda and sharedbuf.pin(theta) and (snapshot is None or sharedbuf.pin(snapshot))

    def initial(self) -> None:
        """The lane's parameters where the join reads θ_0 from if the run turns out to be new: the
        snapshot buffer, or without one θ_global's buffer (which the join then fills)."""
        if self.snapshot_buf is None:
            self.view.read(0, self.view.numel, self.theta)
        else:
            self.snapshot(0, 1, keep=False)

    def snapshot(self, part: int, parts: int, *, keep: bool) -> tuple[torch.Tensor | None, LocalReader | None]:
        """Round's start: fragment `part` of `parts` for the round, and with `keep` the fragment on
        the model's device (returned first) for the merge of an overlapped round. Into the
        snapshot buffer where there is one (a model on the host copied tensor by tensor straight
        into it when nothing is kept: no flat copy between); else a reader of θ_local (returned
        second) for the round to call on its thread."""
        a, b = self.view.fragment(part, parts)
        if self.snapshot_buf is None:
            local = self.view.gather_part(part, parts) if keep else None
            if self.cuda:  # the round's thread reads what this thread's stream wrote
                torch.cuda.current_stream(self.view.device).synchronize()
            if local is not None:
                return local, lambda x, y, out: out.copy_(local[x:y])
            return None, lambda x, y, out: self.view.read(a + x, a + y, out)
        if not keep and self.view.device.type == "cpu":
            self.view.copy_part_into(part, parts, self.snapshot_buf[a:b])
            return None, None
        local = self.view.gather_part(part, parts)
        self._to_host(local, a, b)
        return (local if keep else None), None

    def merge(self, part: int, parts: int, local_at_sync: torch.Tensor | None) -> None:
        """Fragment `part` of θ_global into the model (with overlap: on top of the progress since
        `local_at_sync`)."""
        a, b = self.view.fragment(part, parts)
        if local_at_sync is not None and self.view.merges_in_place:
            self.view.merge_part(self.theta[a:b], local_at_sync, part, parts, non_blocking=self.pinned)
            return
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
