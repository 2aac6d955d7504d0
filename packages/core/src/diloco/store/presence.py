"""Who is there: the markers in a run's ``roster/`` folder that say which replicas a round can
expect, written by the replicas and the launcher alike, read by whoever decides a round.

A replica is named in them by its *incarnation* (`incarnation`): its attempt (a relaunch is a new
attempt) and, within it, its re-run (a platform that runs the same attempt again in place, as
Slurm does on a requeue, numbers the runs: `DILOCO_RERUN`), as one integer that orders them.

Two kinds of marker, each an empty-bodied create-only object whose name is the whole message (so
one LIST of ``<run>/roster/`` reads them all, beside the launcher's scale targets):

- ``join-<rank>.<round>.<incarnation>``: that incarnation of `rank` holds the global state and
  takes part from round `round` on. A replica writes one whenever it (re)joins a run that is
  already past its first round: relaunched, re-run, rejoined from a checkpoint, left out of a round
  it was late for, or added by `diloco scale`. It trains nothing it could lose while it waits for
  round `round − 1` to be decided, so it starts that round with everyone else.
- ``away-<rank>.<incarnation>``: the launcher saw that incarnation of `rank`, and every earlier
  one, end (failed, preempted, out of time, cancelled, given up: the attempt's last incarnation;
  requeued: the run before the requeue): no round waits for that rank until a later incarnation
  announces itself with a join marker.

Nothing here is trusted: a name that does not parse is ignored, never half-read.
`read_presence` is pure, so its rules are a table test (packages/core/tests/test_presence.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .scaling import MAX_RANK

MAX_ATTEMPT = 1 << 20
RERUNS = 1 << 12     # re-runs of one attempt told apart; later ones share the last number
MAX_INCARNATION = MAX_ATTEMPT * RERUNS
MAX_ROUND = 10**12


def incarnation(attempt: int, rerun: int = 0) -> int:
    """One number for run `rerun` (0: the first) of attempt `attempt`, ordered as they happen:
    every re-run of an attempt comes before the attempt after it."""
    return attempt * RERUNS + min(rerun, RERUNS - 1)


def last_incarnation(attempt: int) -> int:
    """The highest number any run of `attempt` can have: an away marker with it says the attempt
    is over, however often the platform re-ran it."""
    return incarnation(attempt, RERUNS - 1)


def rerun_ended(attempt: int, rerun: int) -> int | None:
    """The away marker's incarnation for run `rerun` of `attempt` that ended to be run again in
    place (a requeue): the next run outranks it. None past the re-runs told apart (they would
    share a number): those rounds give the rank a grace window instead."""
    return incarnation(attempt, rerun) if rerun < RERUNS - 1 else None


def join_name(rank: int, round_: int, incarnation: int) -> str:
    """The name (in ``roster/``) of that incarnation of `rank` announcing it takes part from `round_`."""
    return f"join-{rank}.{round_}.{incarnation}"


def away_name(rank: int, incarnation: int) -> str:
    """The name (in ``roster/``) of the launcher's word that `incarnation` of `rank`, and every
    earlier one, is over."""
    return f"away-{rank}.{incarnation}"


def _ints(text: str, count: int, bounds: tuple[int, ...]) -> tuple[int, ...] | None:
    parts = text.split(".")
    if len(parts) != count or not all(p.isascii() and p.isdigit() and len(p) <= 13 for p in parts):
        return None
    values = tuple(int(p) for p in parts)
    return values if all(v < b for v, b in zip(values, bounds)) else None


@dataclass(frozen=True)
class Presence:
    """What the markers say: per rank, its newest announcing incarnation and the rounds it
    announced, and its newest incarnation the launcher saw end."""

    joins: dict[int, tuple[int, frozenset[int]]] = field(default_factory=dict)  # rank -> (incarnation, rounds)
    away: dict[int, int] = field(default_factory=dict)                          # rank -> newest incarnation ended

    def is_away(self, rank: int) -> bool:
        """The launcher saw the rank's incarnation end and no later one has announced itself."""
        if rank not in self.away:
            return False
        joined = self.joins.get(rank)
        return joined is None or joined[0] <= self.away[rank]

    def announced(self, rank: int, round_: int) -> bool:
        """A live incarnation of `rank` said it takes part from `round_`."""
        joined = self.joins.get(rank)
        return joined is not None and round_ in joined[1] and not self.is_away(rank)

    def waits_for_later(self, rank: int, round_: int) -> bool:
        """A live incarnation of `rank` announced a round after `round_` and not `round_` itself: it
        holds the state and waits for that round, training nothing now."""
        joined = self.joins.get(rank)
        return joined is not None and not self.is_away(rank) and round_ not in joined[1] \
            and max(joined[1]) > round_

    def joined(self) -> set[int]:
        """Ranks whose newest incarnation has announced itself and is not known to have ended (the
        ranks `diloco scale` added that are ready to be let in)."""
        return {rank for rank in self.joins if not self.is_away(rank)}


def read_presence(names: Iterable[str]) -> Presence:
    """The markers among the names of a ``roster/`` listing (other names are ignored)."""
    joins: dict[int, tuple[int, frozenset[int]]] = {}
    away: dict[int, int] = {}
    for name in names:
        if name.startswith("join-"):
            got = _ints(name[5:], 3, (MAX_RANK, MAX_ROUND, MAX_INCARNATION))
            if got is not None:
                rank, rnd, inc = got
                have = joins.get(rank)
                if have is None or inc > have[0]:
                    joins[rank] = (inc, frozenset({rnd}))
                elif inc == have[0]:
                    joins[rank] = (inc, have[1] | {rnd})
        elif name.startswith("away-"):
            got = _ints(name[5:], 2, (MAX_RANK, MAX_INCARNATION))
            if got is not None:
                away[got[0]] = max(got[1], away.get(got[0], -1))
    return Presence(joins, away)
