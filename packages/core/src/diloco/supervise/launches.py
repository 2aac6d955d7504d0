"""Relaunches carried out beside the supervisor's loop, so a slow one never blinds it.

A launch can take seconds: a warm template coming up, a cloud API call that retries, a
scheduler that answers slowly. While the supervisor waited on one, it polled no other rank: a
second rank's failure went unseen, its relaunch unscheduled, the run's record unsaved. So a
relaunch is submitted on a worker thread (one at a time, in the order they fell due, as the
executor saw them before) and the supervisor goes on watching; its `RankLauncher`
(`diloco.supervise.ranklauncher`) records the new attempt's handles on the pass after the launch
returns. A launch that returns within `INLINE_WAIT_S` is
recorded on the same pass, as before (most do: a fork, a local process, a fast API).

Executors are therefore called from two threads: `plan`/`submit` of the relaunched ranks on the
worker, `poll`/`collect`/`cancel` of the other ranks on the supervisor's (docs/writing-a-backend.md).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from ..protocol import ReplicaHandle

INLINE_WAIT_S = 1.0  # a launch that returns this soon is recorded on the pass that started it


@dataclass
class Launch:
    """One submission in flight: its ranks, their attempt number, and what the executor answers."""

    ranks: list[int]
    attempt: int
    future: Future[list[ReplicaHandle]]


class BackgroundLaunches:
    """Submissions on one worker thread; `submit(ranks, attempt)` plans and submits them."""

    def __init__(self, submit: Callable[[list[int], int], list[ReplicaHandle]]):
        self._submit = submit
        self._pool: ThreadPoolExecutor | None = None
        self._in_flight: list[Launch] = []

    def in_flight(self) -> set[int]:
        """Ranks whose launch has not been handed back yet."""
        return {r for launch in self._in_flight for r in launch.ranks}

    def start(self, ranks: list[int], attempt: int) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diloco-launch")
        self._in_flight.append(Launch(list(ranks), attempt, self._pool.submit(self._submit, list(ranks), attempt)))

    def wait(self, timeout: float | None) -> None:
        """Wait up to `timeout` seconds (None: for ever) for every launch in flight to return."""
        if self._in_flight:
            wait([launch.future for launch in self._in_flight], timeout=timeout)

    def finished(self) -> list[tuple[Launch, list[ReplicaHandle]]]:
        """The launches that returned since the last call, in the order they were started, each
        with its handles; a launch that raised raises here, on the supervisor's thread, as a
        launch made there would have."""
        done: list[tuple[Launch, list[ReplicaHandle]]] = []
        while self._in_flight and self._in_flight[0].future.done():
            launch = self._in_flight.pop(0)
            done.append((launch, launch.future.result()))
        return done

    def close(self) -> None:
        """Wait for what is in flight (its replicas are the run's) and end the worker."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def by_attempt(ranks: list[int], attempt_of: dict[int, int]) -> list[tuple[int, list[int]]]:
    """`ranks` grouped by the attempt each starts, lowest attempt first: one submission each."""
    groups: dict[int, list[int]] = {}
    for r in ranks:
        groups.setdefault(attempt_of[r], []).append(r)
    return sorted(groups.items())
