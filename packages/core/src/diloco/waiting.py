"""Waiting on replicas: the one polling loop every executor's `collect` uses."""

from __future__ import annotations

import time
from collections.abc import Sequence

from .protocol import ReplicaHandle, ReplicaStatus


def poll_until_terminal(executor, handles: Sequence[ReplicaHandle], *, timeout: float | None,
                        interval: float) -> list[ReplicaStatus]:
    """Poll every handle until all have ended or `timeout` passes; return the last statuses."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        statuses = [executor.poll(h) for h in handles]
        if all(s.is_terminal for s in statuses) or (deadline is not None and time.monotonic() >= deadline):
            return statuses
        time.sleep(interval)
