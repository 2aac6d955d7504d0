"""The part of a model one process syncs (its lane), as one flat fp32 vector on the host.

- A plain module (one process) syncs every parameter.
- Replicated parameters (DDP, or a plain module in each of L processes): process k syncs lane
  k, the k-th of L contiguous slices of the flat parameter vector. After the outer step every
  process needs all of θ, so the lanes are broadcast over the replica's process group, chunk
  by chunk straight into the parameters (NCCL for CUDA parameters, gloo on the host): at most
  one chunk is in flight, never a second full copy of the model.
- Sharded parameters (FSDP2's `fully_shard`, DTensor): each process syncs exactly the shards it
  holds (`to_local()`), and writes them back; no traffic inside the replica at all.

A round reads its fragment with `gather_part` (one flat fp32 vector on the model's device, a
device copy) and puts θ_global back with `write_part`, both through `torch.no_grad` copies, so
any device and dtype works; θ_global and the outer momentum stay on the host (`transfers`).
Fragment p of K (`fragments`) is the p-th of K contiguous slices of each lane, so a round that
updates one fragment touches 1/K of the model and leaves the local progress of the others alone.
"""

from __future__ import annotations

import torch

from diloco.errors import UserError

from .lanes import Lanes
from .storeaccess import shard_bounds

CHUNK = 1 << 22  # elements per broadcast piece (16 MB in fp32)


class ModelView:
    """The lane's parameters as a flat range: `gather_part` into a device vector, `write` back."""

    def __init__(self, params: list[torch.Tensor], start: int, stop: int):
        self.params = params
        self.start, self.stop = start, stop
        self.numel = stop - start

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The storage this process reads and writes: the parameters themselves."""
        return self.params

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device if self.tensors else torch.device("cpu")

    def gather_part(self, part: int, parts: int) -> torch.Tensor:
        """Fragment `part` of `parts` of this lane as a new fp32 vector on the model's device (a
        device copy: what a round snapshots and merges with, never through the host)."""
        a, b = shard_bounds(self.numel, parts)[part]
        pieces = [t.detach().reshape(-1)[x:y].to(torch.float32)
                  for t, x, y, _ in self._pieces(self.start + a, self.start + b)]
        return torch.cat(pieces) if pieces else torch.empty(0, device=self.device)

    def write(self, theta: torch.Tensor) -> None:
        """Put this lane's θ into the model (and, where replicated, every other lane's too)."""
        self.write_part(theta, 0, 1)

    def write_part(self, values: torch.Tensor, part: int, parts: int) -> None:
        """Put fragment `part` of `parts` of this lane into the model (every lane's, where replicated)."""
        self._write_range(self.start + shard_bounds(self.numel, parts)[part][0], values)

    def _write_range(self, start: int, values: torch.Tensor) -> None:
        with torch.no_grad():
            for t, a, b, off in self._pieces(start, start + values.numel()):
                t.view(-1)[a:b].copy_(values[off - start: off - start + (b - a)], non_blocking=False)

    def _pieces(self, start: int, stop: int):
        """(tensor, from, to, flat offset) for each tensor overlapping [start, stop)."""
        offset = 0
        for t in self.tensors:
            n = t.numel()
            a, b = max(start, offset), min(stop, offset + n)
            if a < b:
                yield t, a - offset, b - offset, a
            offset += n
            if offset >= stop:
                break


class ReplicatedView(ModelView):
    """Lane k of L over parameters every process holds whole (DDP)."""

    def __init__(self, params: list[torch.Tensor], lanes: Lanes):
        total = sum(p.numel() for p in params)
        self.bounds = shard_bounds(total, lanes.count)
        super().__init__(params, *self.bounds[lanes.index])
        self.lanes = lanes
        self.total = total

    def write_part(self, values: torch.Tensor, part: int, parts: int) -> None:
        if self.lanes.count == 1:
            return super().write_part(values, part, parts)
        import torch.distributed as dist

        device = self.tensors[0].device if self.tensors else torch.device("cpu")
        on_gpu = device.type == "cuda" and dist.get_backend() == "nccl"
        group = None if on_gpu else self.lanes.group  # NCCL over the replica's GPUs, else diloco's gloo group
        for k, (start, stop) in enumerate(self.bounds):  # lane k's fragment, broadcast from lane k
            x, y = shard_bounds(stop - start, parts)[part]
            a, b = start + x, start + y
            for lo in range(a, b, CHUNK):
                hi = min(b, lo + CHUNK)
                if k == self.lanes.index:
                    piece = values[lo - a: hi - a].to(device if on_gpu else "cpu", non_blocking=False)
                else:
                    piece = torch.empty(hi - lo, dtype=torch.float32, device=device if on_gpu else "cpu")
                try:
                    dist.broadcast(piece, src=k, group=group)
                except RuntimeError as exc:  # a process of the replica died mid-broadcast
                    self.lanes.peer_lost(exc)
                self._write_range(lo, piece)


class ShardedView(ModelView):
    """The shards of FSDP2 parameters this process holds: its lane is exactly those."""

    def __init__(self, params: list[torch.Tensor]):
        super().__init__(params, 0, sum(p.to_local().numel() for p in params))

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [p.to_local() for p in self.params]  # asked each time: FSDP may re-register its shards


def _is_sharded(p: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(p, DTensor)


def model_view(model: torch.nn.Module, lanes: Lanes) -> ModelView:
    """The view of `model` this process syncs: FSDP2 shards, or lane k of replicated parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise UserError("the model has no trainable parameters for DiLoCo to sync")
    sharded = [_is_sharded(p) for p in params]
    if any(sharded):
        if not all(sharded):
            raise UserError("some trainable parameters are FSDP-sharded (DTensor) and some are not; shard the whole "
                            "model with fully_shard, or none of it")
        return ShardedView(params)
    return ReplicatedView(params, lanes)
