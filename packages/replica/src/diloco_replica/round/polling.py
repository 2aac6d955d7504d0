"""Waiting on the store: the one loop every wait of the round protocol runs.

A replica waits for objects other replicas write: the round's ready markers (membership), the
reduced shards (gather), a re-published shard (repairs), round 0's checkpoint pieces (global
state), the other replicas' metrics rows (recorder). Each wait looks at once, then sleeps a
growing interval and looks again, until what it waits for appears, its deadline passes, or it
is woken. The growth makes a wait cost O(log) requests, not a tight loop. The jitter keeps
replicas that started waiting together from listing the store in lockstep. It only shortens a
wait, so no wait is longer than `poll_max`. The deadline is on the round's clock, which stands
still while the store is away (`diloco.store.outage`), so an outage is waited out, not timed out.

    for look in io.poll("round 3's reduced shards", wake=stop):
        with io.store.polling(look > 0):  # every look after the first is a poll
            ...
        if done:
            break
    else:
        ...  # the deadline passed, or `wake` was set
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator

GROWTH = 1.5     # each wait is this much longer than the one before, up to the cap
JITTER = 0.25    # a wait is shortened by up to this fraction, at random


def sleep_or_wake(seconds: float, wake: threading.Event | None) -> bool:
    """Sleep `seconds`; True if `wake` was set meanwhile (then the sleep ends early)."""
    if wake is None:
        time.sleep(seconds)
        return False
    return wake.wait(seconds)


class Poll:
    """One wait for `what` (named for tests and logs): iterate it, look at the store in the body,
    and break once what it waits for is there.

    The iteration yields the number of looks before this one (0: the protocol's own look, then
    re-checks after a wait), and ends when the deadline, `timeout` seconds after the poll began
    on `clock`, has passed, or when `wake` is set. Then:
    - `extend`, if given, is asked whether to wait another `timeout`; it may raise instead;
    - with `final_look`, one more look is yielded at the deadline if the last one came before it
      (the caller's work between looks outlasted the deadline), for a caller whose own rule (not
      the deadline) decides when to stop.
    """

    def __init__(self, what: str, *, first: float, cap: float, timeout: float,
                 clock: Callable[[], float] = time.monotonic, wake: threading.Event | None = None,
                 final_look: bool = False, extend: Callable[[], bool] | None = None, jitter: float = JITTER,
                 rng: random.Random | None = None,
                 sleep: Callable[[float, threading.Event | None], bool] = sleep_or_wake):
        if not 0 <= jitter < 1:
            raise ValueError(f"jitter must be in [0, 1), got {jitter}")
        self.what, self.first, self.cap, self.timeout = what, first, cap, timeout
        self.clock, self.wake, self.final_look, self.extend = clock, wake, final_look, extend
        self.jitter, self.rng, self._sleep = jitter, rng or random.Random(), sleep
        self.started = clock()
        self.deadline = self.started + timeout
        self.delay = first

    def renew(self) -> None:
        """Something arrived: look again soon (the first interval) and wait a whole `timeout` more."""
        self.delay = self.first
        self.deadline = self.clock() + self.timeout

    @property
    def woken(self) -> bool:
        return self.wake is not None and self.wake.is_set()

    def __iter__(self) -> Iterator[int]:
        looks = 0
        while True:
            looked_at = self.clock()
            yield looks
            looks += 1
            if self._wait():
                continue
            if self.woken:
                return
            if self.extend is not None and self.extend():
                self.deadline = self.clock() + self.timeout
                continue
            if self.final_look and looked_at < self.deadline:  # (a sleep cut to the deadline ends in a look)
                yield looks
            return

    def _wait(self) -> bool:
        """Sleep the next interval; False if the deadline has passed or `wake` is set."""
        now = self.clock()
        if now >= self.deadline or self.woken:
            return False
        pause = min(self.delay * (1 - self.jitter * self.rng.random()), self.deadline - now)
        if self._sleep(pause, self.wake):
            return False
        self.delay = min(self.delay * GROWTH, self.cap)
        return True
