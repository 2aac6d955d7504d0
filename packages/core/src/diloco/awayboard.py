"""The launcher's side of presence (`diloco.presence`): an away marker for each attempt it sees
end, so that no round waits for a replica that is gone."""

from __future__ import annotations

from typing import Any

from .runkeys import RunKeys


class AwayBoard:
    """The launcher's side: writes an away marker for each attempt it sees end, once, to the run's
    store (opened on first use). A store that cannot be written costs the rounds a grace window
    each time a replica goes (`diloco_replica.quorum`), never the run: `mark` says so by returning
    the error's text, and the caller records it."""

    def __init__(self, rendezvous: str | None, run_id: str):
        self.rendezvous, self.run_id = rendezvous, run_id
        self._store: Any = None
        self._marked: set[tuple[int, int]] = set()

    def mark(self, rank: int, attempt: int) -> str | None:
        """Say attempt `attempt` of `rank` is over; None once written (or written before), else why not."""
        if (rank, attempt) in self._marked or not self.rendezvous:
            return None
        from .store import ObjectExists, open_store

        try:
            if self._store is None:
                self._store = open_store(self.rendezvous)
            self._store.put(RunKeys(self.run_id).away(rank, attempt), b"", create_only=True)
        except ObjectExists:
            pass
        except Exception as exc:  # noqa: BLE001 - any store failure: the rounds fall back on their grace window
            return f"{type(exc).__name__}: {exc}"
        self._marked.add((rank, attempt))
        return None

    def on_presence(self, rank: int, attempt: int, present: bool, reason: str) -> str | None:
        """The supervisor's `on_presence`: an attempt that ended is marked away. Not one pending
        again (a platform retrying the same attempt, SageMaker's managed spot): it comes back as
        the same attempt, whose join marker could never outrank its away marker; the rounds give
        it a grace window once instead. Returns why a marker could not be written, if so."""
        if present or reason == "pending":
            return None
        return self.mark(rank, attempt)
