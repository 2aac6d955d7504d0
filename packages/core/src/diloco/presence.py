"""Who is there: the markers in a run's ``roster/`` folder that say which replicas a round can
expect, written by the replicas and the launcher alike, read by whoever decides a round.

Two kinds of marker, each an empty-bodied create-only object whose name is the whole message (so
one LIST of ``<run>/roster/`` reads them all, beside the launcher's scale targets):

- ``join-<rank>.<round>.<attempt>``: attempt `attempt` of `rank` holds the global state and takes
  part from round `round` on. A replica writes one whenever it (re)joins a run that is already
  past its first round: relaunched, rejoined from a checkpoint, left out of a round it was late
  for, or added by `diloco scale`. It trains nothing it could lose while it waits for round
  `round − 1` to be decided, so it starts that round with everyone else.
- ``away-<rank>.<attempt>``: the launcher saw attempt `attempt` of `rank` end (failed, preempted,
  out of time, cancelled, given up): no round waits for that rank until an attempt after it
  announces itself with a join marker.

Nothing here is trusted: a name that does not parse is ignored, never half-read.
`read_presence` is pure, so its rules are a table test (packages/core/tests/test_presence.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .scaling import MAX_RANK

MAX_ATTEMPT = 1 << 20
MAX_ROUND = 10**12


def join_name(rank: int, round_: int, attempt: int) -> str:
    """The name (in ``roster/``) of attempt `attempt` of `rank` announcing it takes part from `round_`."""
    return f"join-{rank}.{round_}.{attempt}"


def away_name(rank: int, attempt: int) -> str:
    """The name (in ``roster/``) of the launcher's word that attempt `attempt` of `rank` is over."""
    return f"away-{rank}.{attempt}"


def _ints(text: str, count: int, bounds: tuple[int, ...]) -> tuple[int, ...] | None:
    parts = text.split(".")
    if len(parts) != count or not all(p.isascii() and p.isdigit() and len(p) <= 13 for p in parts):
        return None
    values = tuple(int(p) for p in parts)
    return values if all(v < b for v, b in zip(values, bounds)) else None


@dataclass(frozen=True)
class Presence:
    """What the markers say: per rank, its newest announcing attempt and the rounds that attempt
    announced, and its newest attempt the launcher saw end."""

    joins: dict[int, tuple[int, frozenset[int]]] = field(default_factory=dict)  # rank -> (attempt, rounds)
    away: dict[int, int] = field(default_factory=dict)                          # rank -> newest attempt ended

    def is_away(self, rank: int) -> bool:
        """The launcher saw the rank's attempt end and no later attempt has announced itself."""
        if rank not in self.away:
            return False
        joined = self.joins.get(rank)
        return joined is None or joined[0] <= self.away[rank]

    def announced(self, rank: int, round_: int) -> bool:
        """A live attempt of `rank` said it takes part from `round_`."""
        joined = self.joins.get(rank)
        return joined is not None and round_ in joined[1] and not self.is_away(rank)

    def waits_for_later(self, rank: int, round_: int) -> bool:
        """A live attempt of `rank` announced a round after `round_` and not `round_` itself: it
        holds the state and waits for that round, training nothing now."""
        joined = self.joins.get(rank)
        return joined is not None and not self.is_away(rank) and round_ not in joined[1] \
            and max(joined[1]) > round_

    def joined(self) -> set[int]:
        """Ranks whose newest attempt has announced itself and is not known to have ended (the
        ranks `diloco scale` added that are ready to be let in)."""
        return {rank for rank in self.joins if not self.is_away(rank)}


def read_presence(names: Iterable[str]) -> Presence:
    """The markers among the names of a ``roster/`` listing (other names are ignored)."""
    joins: dict[int, tuple[int, frozenset[int]]] = {}
    away: dict[int, int] = {}
    for name in names:
        if name.startswith("join-"):
            got = _ints(name[5:], 3, (MAX_RANK, MAX_ROUND, MAX_ATTEMPT))
            if got is not None:
                rank, rnd, attempt = got
                have = joins.get(rank)
                if have is None or attempt > have[0]:
                    joins[rank] = (attempt, frozenset({rnd}))
                elif attempt == have[0]:
                    joins[rank] = (attempt, have[1] | {rnd})
        elif name.startswith("away-"):
            got = _ints(name[5:], 2, (MAX_RANK, MAX_ATTEMPT))
            if got is not None:
                away[got[0]] = max(got[1], away.get(got[0], -1))
    return Presence(joins, away)
