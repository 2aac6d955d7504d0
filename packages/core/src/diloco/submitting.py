"""Submitting a plan rank by rank, the same on every backend: all of it starts, or none stays.

A cloud backend starts a replica per API call. If rank k cannot be started (a quota, a bad
image, a throttle that outlasted the retries), the ranks already started would train and bill
on their own, and the supervisor never learns of them: no handle was returned. So they are
cancelled before the error is raised, and the error says so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from .errors import BackendError, UserError
from .protocol import ReplicaHandle


def start_each(ranks: Iterable[int], start: Callable[[int], ReplicaHandle],
               cancel: Callable[[ReplicaHandle], None], *, platform: str, unit: str = "replica(s)") -> list[ReplicaHandle]:
    """`start(rank)` for each rank in order; on a `UserError` or `BackendError`, cancel the ranks
    already started and raise the same kind of error naming the rank, the platform and what was undone."""
    handles: list[ReplicaHandle] = []
    for rank in ranks:
        try:
            handles.append(start(rank))
        except (UserError, BackendError) as exc:
            undone = []
            for h in handles:
                try:
                    cancel(h)
                    undone.append(h)
                except Exception:  # noqa: BLE001 - keep undoing the rest; the first error is the one to report
                    pass
            left = len(handles) - len(undone)
            started = (f"; the {len(undone)} {unit} already started were cancelled" if undone else "") + \
                      (f"; {left} could not be cancelled: stop them by hand" if left else "")
            raise type(exc)(f"launching rank {rank} on {platform} failed: {exc}{started}") from None
    return handles
