"""Who a round waits for, and for how long: pure rules, table-tested (tests/test_quorum.py).

A round's roster (`roster`) names every rank the run has; not all of them are there. A round
waits only for the roster's *expected* ranks, those there is reason to expect:

- in a run's first round, every rank of the roster the launcher has not seen end;
- later, a rank that was a member of the round before, or that a live incarnation of announced for
  exactly this round (a relaunched or late replica rejoining at a round boundary: `presence`), or
  that this round's roster let in for the first time (`diloco scale`);
- never a rank whose incarnation the launcher saw end with no later one announced (`away`), nor
  one whose live incarnation announced a later round only (it holds the state and waits for that
  round to start with everyone else: `exchanger.Exchanger.take_part`).

A rank that missed a round, or that is starting, pending, relaunching or given up, does not hold
the rounds after it: they close as soon as the expected ranks are ready. One that is ready in time
anyway is a member all the same.

An expected rank that is not ready is waited for during a *grace window*, counted from when the
deciding replica was itself ready, of `GRACE_FACTOR` times its recent round period (the median of
the last `PERIODS` intervals between its rounds: compute and exchange; the first is counted from
its start), at least `GRACE_FLOOR` seconds and at most `round_timeout`; `round_grace` sets it
outright. It is set from the run's own pace because the cost of waiting and the size of a normal
delay both scale with it: a replica as fast as the others is never a round late, and one that
is dead costs the others at most one window, once (then it missed a round and is no longer
expected). Decoupled DiLoCo (arXiv 2604.21428) closes its syncs the same way: a minimum quorum,
then a grace window for the rest.

`round_timeout` stays the bound for a round that cannot reach `min_members` ready replicas: it
fails then (`RoundFailed`), as before.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

GRACE_FACTOR = 1.0   # the window, in recent round periods
GRACE_FLOOR = 5.0    # seconds: a window never shorter (scheduling jitter, a slow LIST)
PERIODS = 5          # recent rounds the period is the median of


def expected(roster: Sequence[int], *, first: bool, last_members: Sequence[int], last_roster: Sequence[int],
             announced: set[int], away: set[int], later: set[int] = frozenset()) -> set[int]:
    """The ranks of `roster` a round waits for (see the module's rules). `first`: the run's first
    round (nobody has been a member yet); `last_members`/`last_roster`: the round before's;
    `announced`: ranks a live incarnation announced for this round; `away`: ranks the launcher saw end;
    `later`: ranks a live incarnation announced for a later round only (rejoining: training nothing now)."""
    if first:
        return set(roster) - away - later
    there = set(last_members) | announced | (set(roster) - set(last_roster))
    return (set(roster) & there) - away - later


def grace_seconds(periods: Sequence[float], *, round_timeout: float, setting: float | None = None) -> float:
    """How long a ready replica waits for expected ranks that are not ready (see the module)."""
    if setting is not None:
        return min(float(setting), round_timeout)
    recent = [p for p in periods[-PERIODS:] if p >= 0]
    basis = statistics.median(recent) if recent else 0.0
    return min(max(GRACE_FLOOR, GRACE_FACTOR * basis), round_timeout)


class Verdict(Enum):
    WAIT = "wait"        # poll again
    CLOSE = "close"      # decide the round with the ranks that are ready
    FAIL = "fail"        # round_timeout passed below min_members: the round fails


def verdict(ready: set[int], roster: Sequence[int], expected_ranks: set[int], *, waited: float, grace: float,
            round_timeout: float, min_members: int) -> Verdict:
    """What a ready replica does after `waited` seconds with `ready` ranks ready: close as soon as
    every rank of the roster is ready, or every expected one is (with `min_members` ready); after
    the grace window close with whoever is ready, if that is `min_members`; past `round_timeout`
    close with them or fail."""
    enough = len(ready) >= min_members
    if len(ready) == len(roster) or (enough and expected_ranks <= ready):
        return Verdict.CLOSE
    if waited >= round_timeout:
        return Verdict.CLOSE if enough else Verdict.FAIL
    if enough and waited >= grace:
        return Verdict.CLOSE
    return Verdict.WAIT


@dataclass(frozen=True)
class Absent:
    """Why a roster rank is not in a round (for the log and the membership record)."""

    rank: int
    why: str    # "away" (its incarnation ended), "rejoining" (announced a later round), "late" (expected, not
                # ready within the grace window), "missed" (not expected: missed the last round, or starting)

    @staticmethod
    def of(roster: Sequence[int], ready: set[int], expected_ranks: set[int], away: set[int],
           later: set[int] = frozenset()) -> list[Absent]:
        def why(rank: int) -> str:
            if rank in away:
                return "away"
            if rank in later:
                return "rejoining"
            return "late" if rank in expected_ranks else "missed"

        return [Absent(rank, why(rank)) for rank in roster if rank not in ready]
