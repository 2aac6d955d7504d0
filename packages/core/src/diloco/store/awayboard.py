"""The launcher's side of presence (`diloco.store.presence`): an away marker for each incarnation it
sees end, so that no round waits for a replica that is gone."""

from __future__ import annotations

from typing import Any

from .presence import last_incarnation, rerun_ended
from .runkeys import RunKeys


class AwayBoard:
    """The launcher's side: writes an away marker for each incarnation it sees end, once, to the
    run's store (opened on first use). A store that cannot be written costs the rounds a grace
    window each time a replica goes (`diloco_replica.round.steps.quorum`), never the run: `mark` says so by
    returning the error's text, and the caller records it."""

    def __init__(self, rendezvous: str | None, run_id: str):
        self.rendezvous, self.run_id = rendezvous, run_id
        self._store: Any = None
        self._marked: set[tuple[int, int]] = set()

    def mark(self, rank: int, incarnation: int) -> str | None:
        """Say `incarnation` of `rank` (and every earlier one) is over; None once written (or
        written before), else why not."""
        if (rank, incarnation) in self._marked or not self.rendezvous:
            return None
        from .objectstore import ObjectExists, open_store

        try:
            if self._store is None:
                self._store = open_store(self.rendezvous)
            self._store.put(RunKeys(self.run_id).away(rank, incarnation), b"", create_only=True)
        except ObjectExists:
            pass
        except Exception as exc:  # noqa: BLE001 - any store failure: the rounds fall back on their grace window
            return f"{type(exc).__name__}: {exc}"
        self._marked.add((rank, incarnation))
        return None

    def on_presence(self, rank: int, attempt: int, present: bool, reason: str,
                    rerun: int | None = None) -> str | None:
        """The supervisor's `on_presence`: an attempt that ended is marked away, all its runs. One
        pending again (a platform running the same attempt again in place) is marked away only
        when the platform numbers its runs (`rerun`: the run that ended; Slurm's requeue): the next
        run announces itself one higher. Unnumbered (SageMaker's managed spot) it comes back as
        the same incarnation, whose join marker could never outrank an away marker; the rounds
        give it a grace window once instead. Returns why a marker could not be written, if so."""
        if present:
            return None
        if reason == "pending":
            ended = None if rerun is None else rerun_ended(attempt, rerun)
            return None if ended is None else self.mark(rank, ended)
        return self.mark(rank, last_incarnation(attempt))
