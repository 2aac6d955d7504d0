"""The processes of one replica, and how they agree.

A replica of L processes (torchrun, `processes_per_replica = L`) syncs as L lanes: process k
owns lane k — 1/L of the flat parameter vector with DDP, or exactly the shards it holds with
FSDP2 — and runs the store all-reduce for that lane only, so the replica's bytes move over L
connections at once. What must be decided once per replica is decided by lane 0 and shared:
a round's members, which checkpoint to load, whether this replica's state diverged. What every
lane does on its own (upload, reduce, gather, replay) ends in an agreement, so a lane that fell
behind takes the whole replica with it into the same rejoin, and no lane is left waiting in a
collective the others never enter.

The messages are a few bytes of JSON over a gloo group of diloco's own (never pickle, never the
user's NCCL stream): all-gather of lengths, then of the bytes. With L = 1 every method is a
plain call and nothing is exchanged.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

from diloco.errors import UserError

from ..transport.finite import NonFinite
from .errors import FellBehind, RoundFailed

T = TypeVar("T")


class PeerLost(RoundFailed):
    """Another process of this replica died: torchrun is about to stop this one."""

    def wait_to_be_stopped(self) -> NoReturn:
        """Sleep on the main thread, where torchrun's SIGTERM ends the process at once (a thread
        asleep here would hold the interpreter's exit until SIGKILL), then raise."""
        time.sleep(PEER_LOST_WAIT_S)
        raise self


class Retry(Exception):
    """A lane saw the store change under it (a checkpoint vanished): the replica tries again."""


# What a failure in one lane becomes in the others (anything else: RoundFailed naming the lane).
_KINDS: dict[str, type[Exception]] = {"FellBehind": FellBehind, "RoundFailed": RoundFailed, "Retry": Retry,
                                      "UserError": UserError, "NonFinite": NonFinite}


# A process whose peer died sees its next exchange fail; torchrun notices the death within its
# monitor interval and stops the rest with SIGTERM. Waiting for that (instead of failing with a
# second, misleading error) leaves the first failure as the replica's only one.
PEER_LOST_WAIT_S = 60.0


class Lanes:
    def __init__(self, index: int = 0, count: int = 1, group: Any = None,
                 log: Callable[[str], None] | None = None, clock: Any = None):
        self.index, self.count, self.group = index, count, group
        self.clock = clock  # a second group, for the per-step agreement of time-based rounds (`any_of`)
        self.log = log or (lambda msg: None)

    @property
    def leader(self) -> bool:
        return self.index == 0

    @classmethod
    def join(cls, lanes: int, lane: int, log: Callable[[str], None] | None = None, *, clock: bool = False) -> Lanes:
        """The lanes of this process's replica (torchrun's group), or a single lane. `clock`: also a
        group for `any_of` (time-based rounds; every lane of a replica runs the same settings)."""
        if lanes <= 1:
            return cls()
        import torch.distributed as dist

        if not dist.is_initialized():  # a plain module under torchrun: the group is only ours
            dist.init_process_group("gloo")
        if dist.get_world_size() != lanes or dist.get_rank() != lane:
            raise UserError(f"torch.distributed's group has {dist.get_world_size()} processes (this is rank "
                            f"{dist.get_rank()}) but the replica has {lanes} (this is process {lane}); DiLoCo "
                            f"syncs the group torchrun started: call init_process_group() without a world size")
        group = dist.new_group(backend="gloo")
        # its own group: `any_of` runs on the training thread every inner step while a round's
        # record (`exchange`) may be running on a pool thread; one group for both mixes their messages
        return cls(lane, lanes, group, log, clock=dist.new_group(backend="gloo") if clock else None)

    # -- exchanges ---------------------------------------------------------------------------

    def exchange(self, obj: Any) -> list[Any]:
        """Every lane's `obj` (JSON-able), in lane order."""
        if self.count == 1:
            return [obj]
        import torch
        import torch.distributed as dist

        data = json.dumps(obj).encode()
        try:
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.count)]
            dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=self.group)
            longest = max(int(s) for s in sizes)
            mine = torch.zeros(longest, dtype=torch.uint8)
            mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            out = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.count)]
            dist.all_gather(out, mine, group=self.group)
        except RuntimeError as exc:  # gloo: a peer closed its connection (it died)
            self.peer_lost(exc)
        return [json.loads(bytes(t[:int(s)].tolist())) for t, s in zip(out, sizes)]

    def peer_lost(self, exc: BaseException) -> None:
        """A collective failed because another process of the replica died: wait to be stopped
        (on the main thread; a round's thread raises `PeerLost` for the main thread to wait)."""
        self.log("another process of this replica stopped; waiting for torchrun to stop this one")
        lost = PeerLost(f"another process of this replica stopped: {str(exc).splitlines()[0]}")
        if threading.current_thread() is threading.main_thread():
            lost.wait_to_be_stopped()
        raise lost from None

    def agree(self, fn: Callable[[], T]) -> T:
        """Every lane runs `fn`; if any lane failed, every lane raises (its own error, or the first one's kind)."""
        if self.count == 1:
            return fn()
        value: Any = None
        error: BaseException | None = None
        try:
            value = fn()
            status: dict[str, Any] = {"ok": True}
        except Exception as exc:  # shared below, then raised in every lane
            error = exc
            status = {"ok": False, "kind": type(exc).__name__, "message": str(exc)}
        statuses = self.exchange(status)
        failed = [(k, s) for k, s in enumerate(statuses) if not s["ok"]]
        if not failed:
            return value
        if error is not None:
            raise error
        k, first = failed[0]
        kind = _KINDS.get(first["kind"])
        if kind is None:
            raise RoundFailed(f"process {k} of this replica failed: {first['kind']}: {first['message']}")
        raise kind(first["message"])

    def on_leader(self, fn: Callable[[], T]) -> T:
        """Lane 0 runs `fn` and every lane gets its (JSON-able) result, or raises its error."""
        if self.count == 1:
            return fn()
        value: Any = None
        status: dict[str, Any] = {"ok": True}
        error: BaseException | None = None
        if self.leader:
            try:
                value = fn()
                status = {"ok": True, "value": value}
            except Exception as exc:
                error = exc
                status = {"ok": False, "kind": type(exc).__name__, "message": str(exc)}
        first = self.exchange(status if self.leader else None)[0]
        if first["ok"]:
            return value if self.leader else first["value"]
        if error is not None:
            raise error
        raise _KINDS.get(first["kind"], RoundFailed)(first["message"])

    def any_of(self, flag: bool) -> bool:
        """Whether any lane's `flag` is set (time-based rounds: has any process's clock run out?)."""
        if self.count == 1:
            return flag
        if self.clock is None:
            raise RuntimeError("Lanes.any_of needs the clock group: Lanes.join(..., clock=True)")
        import torch
        import torch.distributed as dist

        value = torch.tensor([int(flag)], dtype=torch.int32)
        try:
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.clock)
        except RuntimeError as exc:  # gloo: a peer closed its connection (it died)
            self.peer_lost(exc)
        return bool(value.item())

    def largest(self, x: int) -> int:
        return max(self.exchange(x))

    def total(self, counts: dict[str, float]) -> dict[str, float]:
        """Key-wise sum over lanes (the replica's bytes, requests, tokens, from each lane's own)."""
        if self.count == 1:
            return dict(counts)
        rows = self.exchange(counts)
        return {k: sum(r.get(k, 0) for r in rows) for k in counts}

    def close(self) -> None:
        if self.group is not None:
            import torch.distributed as dist

            try:
                if self.clock is not None:
                    dist.destroy_process_group(self.clock)
                dist.destroy_process_group(self.group)
            except Exception:  # the default group may already be gone at interpreter exit
                pass
            self.group = None
