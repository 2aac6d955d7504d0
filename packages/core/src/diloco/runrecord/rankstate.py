"""One rank of a supervised run, as the run record keeps it: its current attempt's handle, its
status, its budgets and every attempt it had."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ..protocol import ReplicaHandle, ReplicaStatus
from ..records import from_record, to_record


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
    time_limits: int = 0                 # times it was relaunched after reaching a time limit
    relaunch_paid: bool = False          # the scheduled relaunch was paid when decided (a preemption, a time limit)
    cancelled_outside_at: float | None = None  # when its latest attempt was seen cancelled outside diloco
    group: str | None = None             # its replica group's name, in a run with [[group]] tables
    retired: bool = False                # scaled away (`diloco scale`): it leaves after its round, never relaunched

    def to_dict(self) -> dict[str, Any]:
        return to_record(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankState:
        return from_record(cls, data, where=f"rank {data.get('rank', '?') if isinstance(data, dict) else '?'}")
