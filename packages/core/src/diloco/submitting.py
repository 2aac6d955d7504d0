"""Submitting a plan rank by rank, the same on every backend: all of it starts, or none stays.

A cloud backend starts a replica per API call. If rank k cannot be started (a quota, a bad
image, a throttle that outlasted the retries, an SDK exception the backend never wrapped, a
Ctrl-C), the ranks already started would train and bill on their own, and the supervisor never
learns of them: no handle was returned. So they are cancelled before the error goes on, whatever
the error is, and the error says so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

from .errors import BackendError, UserError
from .protocol import ReplicaHandle

T = TypeVar("T")


def start_each(ranks: Iterable[int], start: Callable[[int], ReplicaHandle],
               cancel: Callable[[ReplicaHandle], None], *, platform: str, unit: str = "replica(s)") -> list[ReplicaHandle]:
    """`start(rank)` for each rank in order; the handles in that order.

    If `start` raises anything, `cancel(handle)` undoes each rank already started (a cancel that
    fails does not stop the others), and the error goes on naming the rank, the platform and
    what was undone: a `UserError` or `BackendError` as one line of the same type; any other
    exception (a bug, KeyboardInterrupt) unchanged, with its traceback and that line as a note."""
    return start_all(ranks, lambda rank: [start(rank)], cancel, unit=unit,
                     failed=lambda rank: f"launching rank {rank} on {platform} failed")


def start_all(units: Iterable[T], start: Callable[[T], list[ReplicaHandle]], cancel: Callable[[ReplicaHandle], None],
              *, failed: Callable[[T], str], unit: str = "replica(s)") -> list[ReplicaHandle]:
    """`start(u)` for each unit in order (a rank, or a whole group's plan), each giving its
    handles; all of them in that order. On an error, as `start_each` says, `failed(u)` naming the
    unit that could not start."""
    handles: list[ReplicaHandle] = []
    for u in units:
        try:
            handles += start(u)
        except BaseException as exc:
            what, undone = failed(u), _undo(handles, cancel, unit)
            if isinstance(exc, (UserError, BackendError)):
                raise type(exc)(f"{what}: {exc}{undone}") from None
            exc.add_note(f"diloco: {what}{undone}")
            raise
    return handles


def _undo(handles: list[ReplicaHandle], cancel: Callable[[ReplicaHandle], None], unit: str) -> str:
    """Cancel every started handle; what was undone, in words (empty when nothing had started)."""
    undone = 0
    for h in handles:
        try:
            cancel(h)
            undone += 1
        except Exception:  # noqa: BLE001 - keep undoing the rest; the launch's error is the one to report
            pass
    left = len(handles) - undone
    return (f"; the {undone} {unit} already started were cancelled" if undone else "") + \
           (f"; {left} could not be cancelled: stop them by hand" if left else "")
