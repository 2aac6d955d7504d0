"""Where a round's time went: seconds per named phase (upload, reduce, gather, …), measured
back to back from one clock, for the round's metrics row.

The clock starts where the round starts for the training loop (`since`, before its snapshot), so
that the phases account for the whole round and nothing it spends goes unnamed. CLOCK_MONOTONIC
is one clock for every process of a host, so a sync process can lap from the training process's
start."""

from __future__ import annotations

import time


class Laps:
    """Seconds spent in each named phase, measured back to back from one clock."""

    def __init__(self, since: float | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.monotonic() if since is None else since

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._last
        self._last = now

    @property
    def at(self) -> float:
        """The instant the last lap ended: where whoever takes the result over goes on counting."""
        return self._last
