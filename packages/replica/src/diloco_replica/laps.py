"""Where a round's time went: seconds per named phase (upload, reduce, gather, …), measured
back to back from one clock, for the round's metrics row."""

from __future__ import annotations

import time


class Laps:
    """Seconds spent in each named phase, measured back to back from one clock."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.monotonic()

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._last
        self._last = now
