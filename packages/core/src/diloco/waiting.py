"""Waiting on replicas: the one polling loop every executor's `collect` uses, and the results
of replicas that report through their logs."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence

from .backendapi import outdated
from .inputs.resultline import result_from_log
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
    return [unless_failed(h, s, lambda h=h: result_from_log(executor.stream_logs(h, n_lines=20))) or failure(h, s)
            for h, s in zip(handles, statuses)]


def unless_failed(handle: ReplicaHandle, status: ReplicaStatus, returned: Callable[[], object], *,
                  cancelled: str = "cancelled") -> ReplicaResult | None:
    """The result of a replica that did not fail, the same on every backend: cancelled (`cancelled`
    says by whom, where the platform knows), succeeded (the entrypoint's return value, asked of
    `returned()` only then: the runner's result file or its last log line), or not ended yet.
    None for a failure, which the backend explains in its platform's words."""
    if _takes_arguments(returned):  # backend API 1 passed read_log(n_lines)
        raise outdated("unless_failed(handle, status, read_log)",
                       "unless_failed(handle, status, lambda: result_from_log(read_log(20)))", 1)
    if status is ReplicaStatus.CANCELLED:
        return ReplicaResult(handle.rank, status, None, cancelled, None, handle.attempt)
    if status is ReplicaStatus.SUCCEEDED:
        return ReplicaResult(handle.rank, status, 0, None, returned(), handle.attempt)
    if not status.is_terminal:
        return ReplicaResult(handle.rank, status, None, None, None, handle.attempt)
    return None


def _takes_arguments(fn: Callable) -> bool:
    """Whether `fn` needs a positional argument (an API 1 `read_log`, not an API 2 `returned`)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: take it at its word
        return False
    return any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters)
