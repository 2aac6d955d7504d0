"""Waiting on replicas: the one polling loop every executor's `collect` uses, and the results
of replicas that report through their logs."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from .protocol import ReplicaHandle, ReplicaResult, ReplicaStatus


class LastStatus:
    """The status each replica was last read in. A poll the platform did not answer (throttled,
    unreachable) returns it instead of guessing: it stands until the platform answers again, and
    a replica never read yet is PENDING."""

    def __init__(self) -> None:
        self._seen: dict[str, ReplicaStatus] = {}

    def saw(self, key: str, status: ReplicaStatus) -> ReplicaStatus:
        self._seen[key] = status
        return status

    def last(self, key: str) -> ReplicaStatus:
        return self._seen.get(key, ReplicaStatus.PENDING)


def poll_until_terminal(executor, handles: Sequence[ReplicaHandle], *, timeout: float | None,
                        interval: float) -> list[ReplicaStatus]:
    """Poll every handle until all have ended or `timeout` passes; return the last statuses."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        statuses = [executor.poll(h) for h in handles]
        if all(s.is_terminal for s in statuses) or (deadline is not None and time.monotonic() >= deadline):
            return statuses
        time.sleep(interval)


def collect_results(executor, handles: Sequence[ReplicaHandle], *, timeout: float | None, interval: float,
                    failure: Callable[[ReplicaHandle, ReplicaStatus], ReplicaResult]) -> list[ReplicaResult]:
    """`collect` for a backend whose replicas report through their logs: each handle polled until
    it ends (or `timeout`), its result read as `unless_failed` says, and `failure(handle, status)`
    asked only for a replica that failed, which the backend explains in its platform's words."""
    statuses = poll_until_terminal(executor, handles, timeout=timeout, interval=interval)
    return [unless_failed(h, s, lambda n, h=h: executor.stream_logs(h, n_lines=n)) or failure(h, s)
            for h, s in zip(handles, statuses)]


def unless_failed(handle: ReplicaHandle, status: ReplicaStatus, read_log) -> ReplicaResult | None:
    """The result of a replica that did not fail, the same on every backend that has only logs:
    cancelled, succeeded (the entrypoint's return value from the runner's last log line, read with
    `read_log(n_lines)`), or not ended yet. None for a failure, which the backend explains itself."""
    from .runner import result_from_log

    if status is ReplicaStatus.CANCELLED:
        return ReplicaResult(handle.rank, status, None, "cancelled", None, handle.attempt)
    if status is ReplicaStatus.SUCCEEDED:
        return ReplicaResult(handle.rank, status, 0, None, result_from_log(read_log(20)), handle.attempt)
    if not status.is_terminal:
        return ReplicaResult(handle.rank, status, None, None, None, handle.attempt)
    return None
