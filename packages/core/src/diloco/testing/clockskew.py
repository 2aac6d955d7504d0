"""Skewed wall clocks for tests: replicas whose `time.time()` is off by seconds, or jumps.

Hosts' wall clocks disagree (NTP not yet synced on a fresh node, a VM resumed from a snapshot)
and jump (NTP stepping a clock). Rounds, timeouts and the timeline must not depend on them
agreeing. A process of rank R started with

    DILOCO_FAULT_CLOCK_SKEW="<rank>:<seconds>[@<after_s>:<seconds>],..."

reads a wall clock off by `seconds` (`0:30,1:-30`: rank 0 is 30 s ahead, rank 1 30 s behind),
and, with `@after_s:seconds`, one that jumps to the second offset `after_s` seconds after it
started (`2:0@6:45`: rank 2 right for 6 s, then 45 s ahead). Only the wall clock is skewed
(`time.time`, `time.time_ns`): monotonic clocks are what NTP never steps, and what a process's
deadlines must use. The replica's runner and its sync process install it (`install_from_env`);
libfaketime cannot stand in here, as it breaks Python's sleeps (EINVAL from clock_nanosleep).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

from diloco.envvars import ENV_FAULT_CLOCK_SKEW as ENV_CLOCK_SKEW


def parse(text: str) -> dict[int, tuple[float, float | None, float]]:
    """{rank: (offset, after_s or None, offset after)} from the variable's value."""
    out: dict[int, tuple[float, float | None, float]] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        try:
            rank, rest = item.split(":", 1)
            first, _, jump = rest.partition("@")
            after, then = (jump.split(":", 1) if jump else (None, first))
            out[int(rank)] = (float(first), float(after) if after is not None else None, float(then))
        except ValueError:
            raise ValueError(f"{ENV_CLOCK_SKEW}: {item!r} is not <rank>:<seconds>[@<after_s>:<seconds>]") from None
    return out


def install_from_env(rank: int, env: Mapping[str, str] | None = None) -> bool:
    """Skew this process's wall clock if the variable names `rank`; True if it did."""
    env = os.environ if env is None else env
    skew = parse(env.get(ENV_CLOCK_SKEW, "")).get(rank)
    if skew is None:
        return False
    first, after, then = skew
    real_time, real_time_ns, started = time.time, time.time_ns, time.monotonic()

    def offset() -> float:
        return then if after is not None and time.monotonic() - started >= after else first

    time.time = lambda: real_time() + offset()
    time.time_ns = lambda: real_time_ns() + int(offset() * 1e9)
    return True
