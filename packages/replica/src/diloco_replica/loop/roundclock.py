"""When a round is due: after H inner steps, or (time-based rounds, `round_seconds`) at its deadline.

A time-based round closes round_seconds after it began on this replica, at the step that ends
nearest the deadline (once it is less than half a step away), so a replica with long steps is
not late by half a step every round. A step is timed by the median of the last five, and an
evaluation is no step, so one stall does not close a round early. The processes of a replica
agree every step (each reads its own clock), on the lanes' clock group.
"""

from __future__ import annotations

import time
from collections import deque

from ..round.lanes import Lanes


class RoundClock:
    def __init__(self, stride: int, round_seconds: float | None, lanes: Lanes):
        self.stride, self.round_seconds, self.lanes = stride, round_seconds, lanes
        self.phase_start = self._step_at = time.monotonic()
        self._step_times: deque[float] = deque(maxlen=5)

    def restart(self) -> None:
        """A new inner phase begins now."""
        self.phase_start = self._step_at = time.monotonic()

    def not_a_step(self) -> None:
        """Time since the last step went to something else (an evaluation): do not time it as one."""
        self._step_at = time.monotonic()

    def due(self, local_steps: int) -> bool:
        """Called once per inner step, after it: whether the round closes now."""
        if self.round_seconds is None:
            return local_steps >= self.stride
        now = time.monotonic()
        self._step_times.append(now - self._step_at)
        self._step_at = now
        step_s = sorted(self._step_times)[len(self._step_times) // 2]
        due = local_steps >= self.stride or now + step_s / 2 >= self.phase_start + self.round_seconds
        return self.lanes.any_of(due)
