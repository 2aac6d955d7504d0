"""One rank of a supervised run, as the run record keeps it: its current attempt's handle, its
status, its budgets and every attempt it had."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from .protocol import ReplicaHandle, ReplicaStatus


class RankStatus(str, Enum):
    """A rank's status in the record: a replica status, or stopped by the supervisor itself
    (a gang restart or a failed run) before it ended. Compares equal to its string value."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    CANCELLED_BY_SUPERVISOR = "cancelled_by_supervisor"

    @classmethod
    def of(cls, status: ReplicaStatus) -> RankStatus:
        return cls(status.value)

    @property
    def live(self) -> bool:
        return self in (RankStatus.PENDING, RankStatus.RUNNING)

    @property
    def ended(self) -> bool:
        return self in (RankStatus.SUCCEEDED, RankStatus.FAILED, RankStatus.CANCELLED)

    def __str__(self) -> str:
        return self.value


@dataclass
class RankState:
    rank: int
    handle: ReplicaHandle | None = None
    status: RankStatus = RankStatus.PENDING
    restarts: int = 0
    given_up: bool = False
    relaunch_at: float | None = None
    last_error: str | None = None
    result: Any = None
    attempts: list[dict[str, Any]] = field(default_factory=list)  # every attempt's handle
    launched_at: float | None = None     # when the current attempt was launched
    failure_signature: str | None = None  # the latest failure's cause, if training code raised it
    failed_soon: bool = False            # whether that failure came within fail_fast_seconds of launch
    preemptions: int = 0                 # times the platform took this rank's machine away
    preempted: bool = False              # the scheduled relaunch replaces a preempted attempt
    group: str | None = None             # its replica group's name, in a run with [[group]] tables

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "handle": self.handle.to_dict() if self.handle else None,
                "status": self.status.value, "restarts": self.restarts, "given_up": self.given_up,
                "relaunch_at": self.relaunch_at, "last_error": self.last_error, "result": self.result,
                "attempts": self.attempts, "launched_at": self.launched_at,
                "failure_signature": self.failure_signature, "failed_soon": self.failed_soon,
                "preemptions": self.preemptions, "preempted": self.preempted, "group": self.group}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankState:
        handle = ReplicaHandle.from_dict(data["handle"]) if data.get("handle") else None
        return cls(rank=data["rank"], handle=handle, status=RankStatus(data.get("status", "pending")),
                   restarts=data.get("restarts", 0), given_up=data.get("given_up", False),
                   relaunch_at=data.get("relaunch_at"), last_error=data.get("last_error"),
                   result=data.get("result"), attempts=list(data.get("attempts", [])),
                   launched_at=data.get("launched_at"), failure_signature=data.get("failure_signature"),
                   failed_soon=data.get("failed_soon", False), preemptions=data.get("preemptions", 0),
                   preempted=data.get("preempted", False), group=data.get("group"))
