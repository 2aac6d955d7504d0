"""A store that stops answering for a while is waited for, not taken for a broken one.

Object stores have outages: a region answering 503 SlowDown for minutes, a MinIO node
restarting, the network path to the store dropped. A request's own retries (obstore's, a few
within seconds: `REQUEST_RETRIES`) ride out a blip; a longer outage reaches `Outage`, which
holds one process's view of it: since when a request has kept failing, what the store last
said, and how long that may last (`[diloco] store_outage_limit`) before the process gives up with one
line naming the store (`StoreUnreachable`).

Only errors that say the store could not be reached, could not answer, or cannot take writes
for now (`is_transient`: connection failures, timeouts, 5xx, throttling, a request that used up
its retries, a full disk or quota behind a file:// store, which someone can free) are waited
for. A store that answers no (credentials refused, no such bucket, a bad request) made a
decision that waiting will not change: that error is raised at once, as before.

While the store is away the process's round clock (`Outage.clock`) stands still, so a round's
timeouts count only time in which the store could be used: an outage longer than
`round_timeout` fails no round, and when the store is back every deadline is where it was.
"""

from __future__ import annotations

import errno
import re
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from ..errors import DilocoError

T = TypeVar("T")

# What one request retries by itself (obstore's RetryConfig) before an error reaches `Outage`:
# enough for a dropped connection or a lone 503, short enough that a launcher polling the store
# is never held for long (obstore's own default retries for up to 3 minutes).
REQUEST_RETRIES = {"max_retries": 4, "retry_timeout_s": 15.0, "init_backoff_s": 0.1, "max_backoff_s": 2.0}

# Waits between tries of a request while the store is away: from half a second, doubling, to 10 s.
WAIT_FIRST_S, WAIT_MAX_S = 0.5, 10.0

# An error that says the store was not reached or did not answer. obstore says "after N retries"
# only of errors of a kind it retries (connection, timeout, 5xx); the rest are for stores and
# clients that say it in their own words.
_TRANSIENT = re.compile(
    r"after \d+ retries|error sending request|connect(ion)? (refused|reset|error|closed|timed out)|tcp connect"
    r"|timed out|timeout|dns error|broken pipe|reset by peer|status(?: code)?:? 5\d\d|\b50[0234] "
    r"|\b429\b|slow ?down|service unavailable|internal ?(server )?error|bad gateway|too many requests|throttl"
    r"|no space left on device|os error 28\b|disk quota exceeded|os error 122\b",
    re.IGNORECASE)
# Errors that are an answer: the store decided, and asking again gets the same answer.
_ANSWERS = ("NotFoundError", "PermissionDeniedError", "UnauthenticatedError", "AlreadyExistsError",
            "PreconditionError", "NotModifiedError", "NotSupportedError", "InvalidPathError",
            "UnknownConfigurationKeyError", "ObjectExists")


def is_transient(exc: BaseException) -> bool:
    """Whether `exc` says the store could not be reached, could not answer, or is full for now
    (waiting may help), rather than that it answered no (waiting will not)."""
    if type(exc).__name__ in _ANSWERS or isinstance(exc, (FileNotFoundError, PermissionError)):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, OSError):  # a local store's disk: full (someone can free it) or broken (an answer)
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return bool(_TRANSIENT.search(first_line(exc)))


def first_line(exc: BaseException) -> str:
    """The error's first line (obstore's messages go on with a multi-line debug dump)."""
    text = str(exc).split("Debug source:", 1)[0].strip()
    return text.splitlines()[0].strip() if text else type(exc).__name__


class StoreUnreachable(DilocoError):
    """A request to the store failed for longer than the outage limit. Not a spec mistake: a
    process started elsewhere, or later, may reach it."""


class Outage:
    """One process's view of its store's reachability, shared by every thread that uses the store.

    The store is away while at least one request keeps failing: one that succeeds meanwhile (a
    read, while a full disk refuses writes) does not end the outage. Each request gives up once
    it has failed for `limit_s`."""

    def __init__(self, uri: str, limit_s: float | None, *, log: Callable[[str], None] | None = None,
                 now: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        self.uri, self.limit_s = uri, limit_s
        self._log, self._now, self._sleep = log, now, sleep
        self._lock = threading.Lock()
        self._failing: dict[int, float] = {}  # requests failing now: id → when each started
        self._ids = 0
        self.since: float | None = None  # when the store last stopped serving a request (this process's clock)
        self.error: str | None = None    # what it last said, while away
        self.away_s = 0.0                # seconds it was away in outages that ended

    def clock(self) -> float:
        """Seconds on a clock that stands still while the store is away: round deadlines use it."""
        with self._lock:
            now = self._now()
            return now - self.away_s - (now - self.since if self.since is not None else 0.0)

    def gone_for(self) -> float:
        """Seconds the store has been away now (0 while every request it gets is served)."""
        with self._lock:
            return 0.0 if self.since is None else self._now() - self.since

    def call(self, fn: Callable[[], T]) -> T:
        """`fn()`, tried again while it fails transiently, until the store serves it or it has
        failed for `limit_s` (then StoreUnreachable); any other error is raised at once. A request
        served at its first try (nearly all) costs nothing more than `fn()`."""
        started = self._now()
        try:
            return fn()
        except BaseException as exc:
            if not is_transient(exc):
                raise
            first = exc
        import random

        import tenacity

        with self._lock:
            self._ids += 1
            me = self._ids
        try:
            self._failed(me, started, first)
            if self._past_limit(started):
                self._give_up(me, started, first)
            self._sleep(WAIT_FIRST_S + random.uniform(0, WAIT_FIRST_S))  # then 1 s, 2 s, … as tenacity counts on
            retrying = tenacity.Retrying(
                retry=tenacity.retry_if_exception(is_transient),
                wait=tenacity.wait_exponential(multiplier=2 * WAIT_FIRST_S, max=WAIT_MAX_S)
                + tenacity.wait_random(0, WAIT_FIRST_S),
                stop=lambda state: self._past_limit(started),
                before_sleep=lambda state: self._failed(me, started, state.outcome.exception()), sleep=self._sleep)
            try:
                result = retrying(fn)
            except tenacity.RetryError as exc:
                self._give_up(me, started, exc.last_attempt.exception())
        except BaseException:
            self._done(me, served=False)
            raise
        self._done(me)
        return result

    def _past_limit(self, started: float) -> bool:
        return self.limit_s is not None and self._now() - started >= self.limit_s

    def _give_up(self, me: int, started: float, failure: BaseException | None) -> None:
        self._failed(me, started, failure)
        raise StoreUnreachable(f"rendezvous {self.uri!r}: a request has failed for {self._now() - started:.0f} s "
                               f"(store_outage_limit = {self.limit_s:g} s): {first_line(failure)}") from None

    def _failed(self, me: int, started: float, failure: BaseException | None) -> None:
        with self._lock:
            self._failing.setdefault(me, started)
            first = self.since is None
            if first:
                self.since = started
            self.error = first_line(failure) if failure is not None else self.error
        if first and self._log is not None:
            limit = f"up to {self.limit_s:g} s (store_outage_limit)" if self.limit_s is not None else "without a limit"
            self._log(f"store {self.uri!r} is not serving requests: {self.error}; waiting for it {limit}")

    def _done(self, me: int, served: bool = True) -> None:
        """Request `me` ended (`served`, or given up): the outage ends with the last failing one."""
        with self._lock:
            if self._failing.pop(me, None) is None or self._failing or self.since is None:
                return
            away, self.since, self.error = self._now() - self.since, None, None
            self.away_s += away
        if self._log is not None and served:
            self._log(f"store {self.uri!r} serves requests again after {away:.1f} s")
