"""The part of a model one process syncs (its lane), as one flat fp32 vector on the host.

Every lane syncs a contiguous slice of the model's flat parameter vector (`layout.lane_range`),
whatever the parallelism inside the replica, so replicas of any lane count meet in one round:

- A plain module (one process) syncs every parameter.
- Replicated parameters (DDP, or a plain module in each of L processes): process k syncs lane
  k. After the outer step every process needs all of θ, so the lanes are broadcast over the
  replica's process group, chunk by chunk straight into the parameters (NCCL for CUDA
  parameters, gloo on the host): at most one chunk is in flight, never a second full copy.
- Sharded parameters (FSDP2's `fully_shard`, DTensor sharded on dim 0): process k holds rows of
  every parameter, not a slice of the vector, so its lane's values are moved to it by one
  all-to-all over the replica's group as a round begins, and θ_global back the same way (each
  value crosses the replica's interconnect once each way; nothing is gathered whole).

A round reads its fragment with `gather_part` (one flat fp32 vector on the model's device) and
puts θ_global back with `write_part`, both through `torch.no_grad` copies, so any device and
dtype works; θ_global and the outer momentum stay on the host (`transfers`). Fragment p of K
(`fragments`) is the p-th of K contiguous slices of the model; a lane's part of it is what it
holds of that slice (`fragment`), maybe nothing.
"""

from __future__ import annotations

import torch

from diloco.errors import UserError

from ..round.lanes import Lanes
from ..round.layout import clip, lane_fragment, lane_range

CHUNK = 1 << 22  # elements per broadcast piece (16 MB in fp32)


class ModelView:
    """The lane's parameters as a flat range: `gather_part` into a device vector, `write` back."""

    reads_live = True  # `read` gives any range of the lane from the parameters this process holds

    def __init__(self, params: list[torch.Tensor], lanes: Lanes, total: int):
        self.params, self.lanes, self.total = params, lanes, total
        self.start, self.stop = lane_range(total, lanes.count, lanes.index)
        self.numel = self.stop - self.start

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The storage this process reads and writes: the parameters themselves."""
        return self.params

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device if self.tensors else torch.device("cpu")

    def fragment(self, part: int, parts: int) -> tuple[int, int]:
        """What this lane holds of fragment `part` of `parts`, in its own coordinates."""
        return lane_fragment(self.total, self.lanes.count, self.lanes.index, part, parts)

    def gather_part(self, part: int, parts: int) -> torch.Tensor:
        """Fragment `part` of `parts` of this lane as a new fp32 vector on the model's device (a
        device copy: what a round snapshots and merges with, never through the host)."""
        a, b = self.fragment(part, parts)
        pieces = [t.detach().reshape(-1)[x:y].to(torch.float32)
                  for t, x, y, _ in self._pieces(self.start + a, self.start + b)]
        return torch.cat(pieces) if pieces else torch.empty(0, device=self.device)

    def copy_part_into(self, part: int, parts: int, out: torch.Tensor) -> None:
        """Fragment `part` of `parts` of this lane into `out` (fp32, its length) tensor by tensor,
        with no flat copy in between: for a model on the host, where `gather_part`'s vector
        would be one more copy of the fragment in host memory. The same values, exactly."""
        self.read(*self.fragment(part, parts), out)

    def read(self, a: int, b: int, out: torch.Tensor) -> None:
        """Values [a, b) of this lane (its own coordinates) into `out` (fp32 on the host, b − a
        long), tensor by tensor: a round's Δ read a piece at a time while the training loop waits
        for the round, instead of a snapshot of the whole lane (`copy_part_into`: a fragment's)."""
        base = self.start + a
        with torch.no_grad():
            for t, x, y, off in self._pieces(base, self.start + b):
                out[off - base:off - base + (y - x)].copy_(t.detach().reshape(-1)[x:y])

    @property
    def merges_in_place(self) -> bool:
        """Whether an overlapped round's merge can run in the parameters themselves (`merge_part`):
        one process holding fp32 parameters, so adding in place rounds exactly as the flat copy did."""
        return self.reads_live and self.lanes.count == 1 and all(t.dtype == torch.float32 for t in self.tensors)

    def merge_part(self, theta_part: torch.Tensor, local_at_sync: torch.Tensor, part: int, parts: int, *,
                   non_blocking: bool = False) -> None:
        """θ_local_now + θ_global_new − θ_local_at_sync into fragment `part` of `parts`, in the
        parameters, tensor by tensor (`merges_in_place`): the same two separately rounded fp32
        operations as on a flat copy, so the same bits, without the copy of the fragment and of
        θ_global's part that the flat merge holds on the model's device beside the kept one."""
        a, b = self.fragment(part, parts)
        base = self.start + a
        with torch.no_grad():
            for t, x, y, off in self._pieces(base, self.start + b):
                lo, hi = off - base, off - base + (y - x)
                values = t.view(-1)[x:y]
                values += theta_part[lo:hi].to(t.device, non_blocking=non_blocking)
                values -= local_at_sync[lo:hi]

    def write(self, theta: torch.Tensor) -> None:
        """Put this lane's θ into the model (and, where replicated, every other lane's too)."""
        self.write_part(theta, 0, 1)

    def write_part(self, values: torch.Tensor, part: int, parts: int) -> None:
        """Put fragment `part` of `parts` of this lane into the model (every lane's, where replicated)."""
        self._write_range(self.start + self.fragment(part, parts)[0], values)

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

    def _group(self):
        """The replica's group for moving parameters: NCCL's for CUDA ones, diloco's gloo group
        on the host."""
        import torch.distributed as dist

        return None if self.device.type == "cuda" and dist.get_backend() == "nccl" else self.lanes.group


class ReplicatedView(ModelView):
    """Lane k of L over parameters every process holds whole (DDP)."""

    def __init__(self, params: list[torch.Tensor], lanes: Lanes):
        super().__init__(params, lanes, sum(p.numel() for p in params))
        self.bounds = [lane_range(self.total, lanes.count, k) for k in range(lanes.count)]

    def write_part(self, values: torch.Tensor, part: int, parts: int) -> None:
        if self.lanes.count == 1:
            return super().write_part(values, part, parts)
        import torch.distributed as dist

        group = self._group()
        device = self.device if group is None else torch.device("cpu")
        for k, (start, stop) in enumerate(self.bounds):  # lane k's fragment, broadcast from lane k
            x, y = lane_fragment(self.total, self.lanes.count, k, part, parts)
            a, b = start + x, start + y
            for lo in range(a, b, CHUNK):
                hi = min(b, lo + CHUNK)
                if k == self.lanes.index:
                    piece = values[lo - a: hi - a].to(device, non_blocking=False)
                else:
                    piece = torch.empty(hi - lo, dtype=torch.float32, device=device)
                try:
                    dist.broadcast(piece, src=k, group=group)
                except RuntimeError as exc:  # a process of the replica died mid-broadcast
                    self.lanes.peer_lost(exc)
                self._write_range(lo, piece)


class ShardedView(ModelView):
    """FSDP2 parameters (sharded on dim 0 over the replica's processes): lane k syncs its slice
    of the model like any other lane, its values moved from and to the processes holding their
    rows by one all-to-all each way (`_moves`)."""

    reads_live = False  # the lane's values live on other processes: a round snapshots them (`gather_part`)

    def __init__(self, params: list[torch.Tensor], lanes: Lanes):
        super().__init__(params, lanes, sum(p.numel() for p in params))
        from torch.distributed.tensor import Shard

        count, offset = lanes.count, 0
        self.rows: list[list[tuple[int, int]]] = [[] for _ in range(count)]  # lane -> per parameter: its values
        for i, p in enumerate(params):
            placements = getattr(p, "placements", ())
            if p.device_mesh.ndim != 1 or p.device_mesh.size() != count or not (
                    len(placements) == 1 and isinstance(placements[0], Shard) and placements[0].dim == 0):
                raise UserError(f"parameter {i} is sharded as {placements} over a mesh of {p.device_mesh.size()} "
                                f"processes; DiLoCo syncs FSDP2 parameters sharded on dim 0 over the replica's "
                                f"{count} processes (fully_shard on the default 1-D mesh)")
            rows = p.shape[0] if p.dim() else 1
            width, chunk = p.numel() // max(rows, 1), -(-rows // count)
            for k in range(count):  # torch.chunk's split, as FSDP2 shards
                r0, r1 = min(rows, k * chunk), min(rows, (k + 1) * chunk)
                self.rows[k].append((offset + r0 * width, offset + r1 * width))
            x, y = self.rows[lanes.index][i]
            if p.to_local().numel() != y - x:
                raise UserError(f"parameter {i}'s local shard has {p.to_local().numel()} values, not the {y - x} of "
                                f"rows {chunk} per process; DiLoCo syncs FSDP2's even dim-0 sharding")
            offset += p.numel()

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [p.to_local() for p in self.params]  # asked each time: FSDP may re-register its shards

    def _targets(self, part: int, parts: int) -> list[tuple[int, int]]:
        """Each lane's part of the fragment, on the model's vector."""
        out = []
        for k in range(self.lanes.count):
            a, _ = lane_range(self.total, self.lanes.count, k)
            x, y = lane_fragment(self.total, self.lanes.count, k, part, parts)
            out.append((a + x, a + y))
        return out

    def _moves(self, holder: int, target: tuple[int, int]) -> list[tuple[int, int, int]]:
        """(parameter, a, b): the values lane `holder` holds rows of and `target` needs, in order."""
        out = []
        for i, (g0, g1) in enumerate(self.rows[holder]):
            a, b = clip(g0, g1, *target)
            if a < b:
                out.append((i, a, b))
        return out

    def _all_to_all(self, sends: list[list[torch.Tensor]], receive: list[int]) -> torch.Tensor:
        import torch.distributed as dist

        group = self._group()
        device = self.device if group is None else torch.device("cpu")
        flat = [x.to(device, torch.float32) for per_lane in sends for x in per_lane]
        data = torch.cat(flat) if flat else torch.empty(0, device=device)
        out = torch.empty(sum(receive), dtype=torch.float32, device=device)
        try:
            dist.all_to_all_single(out, data, receive, [sum(x.numel() for x in per_lane) for per_lane in sends],
                                   group=group)
        except RuntimeError as exc:  # a process of the replica died mid-exchange
            self.lanes.peer_lost(exc)
        return out.to(self.device)

    def copy_part_into(self, part: int, parts: int, out: torch.Tensor) -> None:
        out.copy_(self.gather_part(part, parts))  # the fragment's rows come from the other processes

    def gather_part(self, part: int, parts: int) -> torch.Tensor:
        me, targets = self.lanes.index, self._targets(part, parts)
        tensors = self.tensors
        with torch.no_grad():
            sends = [[tensors[i].detach().reshape(-1)[a - self.rows[me][i][0]:b - self.rows[me][i][0]]
                      for i, a, b in self._moves(me, target)] for target in targets]
            if self.lanes.count == 1:
                got = torch.cat([x.to(torch.float32) for x in sends[0]]) if sends[0] else torch.empty(0)
                return got.to(self.device)
            received = self._all_to_all(sends, [sum(b - a for _, a, b in self._moves(k, targets[me]))
                                                for k in range(self.lanes.count)])
        lo, hi = targets[me]
        out = torch.empty(hi - lo, dtype=torch.float32, device=self.device)
        pos = 0
        for k in range(self.lanes.count):
            for _, a, b in self._moves(k, targets[me]):
                out[a - lo:b - lo] = received[pos:pos + b - a]
                pos += b - a
        return out

    def write_part(self, values: torch.Tensor, part: int, parts: int) -> None:
        me, targets = self.lanes.index, self._targets(part, parts)
        lo = targets[me][0]
        tensors = self.tensors
        with torch.no_grad():
            if self.lanes.count == 1:
                received, sources = values, [(0, self._moves(0, targets[0]))]
            else:
                sends = [[values[a - lo:b - lo] for _, a, b in self._moves(k, targets[me])]
                         for k in range(self.lanes.count)]
                received = self._all_to_all(sends, [sum(b - a for _, a, b in self._moves(me, targets[m]))
                                                    for m in range(self.lanes.count)])
                sources = [(m, self._moves(me, targets[m])) for m in range(self.lanes.count)]
            pos = 0
            for _, moves in sources:
                for i, a, b in moves:
                    g0 = self.rows[me][i][0]
                    tensors[i].view(-1)[a - g0:b - g0].copy_(received[pos:pos + b - a])
                    pos += b - a


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
        return ShardedView(params, lanes)
    return ReplicatedView(params, lanes)
