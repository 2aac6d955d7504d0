"""Skewed wall clocks for tests: replicas whose `time.time()` is off by seconds, or jumps.

Hosts' wall clocks disagree (NTP not yet synced on a fresh node, a VM resumed from a snapshot)
and jump (NTP stepping a clock). Rounds, timeouts and the timeline must not depend on them
agreeing. A process of rank R started with

    DILOCO_FAULT_CLOCK_SKEW="<rank>:<seconds>[@<when>:<seconds>],..."

reads a wall clock off by `seconds` (`0:30,1:-30`: rank 0 is 30 s ahead, rank 1 30 s behind),
and, with `@when:seconds`, one that jumps to the second offset: `when` seconds after the
process started (`2:0@6:45`: rank 2 right for 6 s, then 45 s ahead), or, where `when` is an
absolute path, once that file exists (`2:0@/tmp/jump:45`). A test that must see rounds on
both sides of the jump creates the file when it has seen them, as seconds since start land
before the first round on an idle machine and in the last ones under load; the runner and
the sync process of one replica then jump together, as one host's clock does. Only the wall
clock is skewed
(`time.time`, `time.time_ns`): monotonic clocks are what NTP never steps, and what a process's
deadlines must use. The replica's runner and its sync process install it (`install_from_env`);
libfaketime cannot stand in here, as it breaks Python's sleeps (EINVAL from clock_nanosleep).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path

from diloco.inputs.envvars import ENV_FAULT_CLOCK_SKEW as ENV_CLOCK_SKEW


Jump = float | Path | None  # seconds after start, a file whose existence jumps it, or never

LOOK_EVERY_S = 0.02  # how often a clock waiting on a file looks for it (time.time is called often)


def parse(text: str) -> dict[int, tuple[float, Jump, float]]:
    """{rank: (offset, when it jumps or None, offset after)} from the variable's value."""
    out: dict[int, tuple[float, Jump, float]] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        try:
            rank, rest = item.split(":", 1)
            first, _, jump = rest.partition("@")
            when, sep, then = jump.rpartition(":")
            if jump and not sep:
                raise ValueError(item)
            at: Jump = None if not jump else Path(when) if when.startswith("/") else float(when)
            out[int(rank)] = (float(first), at, float(then if jump else first))
        except ValueError:
            raise ValueError(f"{ENV_CLOCK_SKEW}: {item!r} is not <rank>:<seconds>[@<after_s or /path>:<seconds>]"
                             ) from None
    return out


def install_from_env(rank: int, env: Mapping[str, str] | None = None) -> bool:
    """Skew this process's wall clock if the variable names `rank`; True if it did."""
    env = os.environ if env is None else env
    skew = parse(env.get(ENV_CLOCK_SKEW, "")).get(rank)
    if skew is None:
        return False
    first, when, then = skew
    real_time, real_time_ns, started = time.time, time.time_ns, time.monotonic()
    jumped, looked = [False], [float("-inf")]

    def offset() -> float:
        if not jumped[0] and when is not None:
            now = time.monotonic()
            if isinstance(when, Path):
                if now - looked[0] >= LOOK_EVERY_S:
                    looked[0] = now
                    jumped[0] = when.exists()
            else:
                jumped[0] = now - started >= when
        return then if jumped[0] else first

    time.time = lambda: real_time() + offset()
    time.time_ns = lambda: real_time_ns() + int(offset() * 1e9)
    return True
