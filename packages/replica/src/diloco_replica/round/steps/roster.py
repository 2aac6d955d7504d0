"""Who is in the run, round by round: a run that grows and shrinks while it trains.

Every round has a *roster*: the ranks expected in it, in order. Its length is the round's N (how
the round is cut, `layout.Cut`) and position p owns shards p·P … p·P + P − 1. Every replica must
use the same roster for a round, so the roster of round r + 1 is decided once, with round r's
members, and written in round r's create-only ``members.json`` (`Decided.next`); checkpoints
carry it too (a replica that rejoins from checkpoint c learns round c + 1's). Round 1's roster
is ranks 0 … N−1 of the launch.

The launcher changes a run's size (`diloco scale`) by writing a *target* under ``roster/``:
``scale-<seq>.json`` (`diloco.store.scaling.roster_body`), create-only, the newest sequence number
wins, holding every rank the run should have. Whoever decides round r reads the newest target and the join markers of
new replicas that have loaded the global state (`diloco.store.presence`, `next_roster`):

- a rank the target drops leaves after round r — it took part in r, its update is in, and it
  exits 0 (the launcher does not relaunch it);
- a rank the target adds comes in at the first round decided after it announced itself ready,
  so no round ever waits for a replica still starting (pods can take minutes to schedule).

Nothing here is trusted: a target that is not a well-formed record for this run is ignored with
a log line, never half-applied.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from diloco.store.presence import Presence, read_presence
from diloco.store.runkeys import RunKeys, scale_seq
from diloco.store.scaling import MAX_RANK, parse_roster
from diloco.store.objectstore import ObjectExists

from ..storeaccess import CountingStore

__all__ = ["MAX_RANK", "Rosters", "Target", "next_roster"]


@dataclass(frozen=True)
class Target:
    """The ranks the launcher wants in the run, from its `seq`-th scale request."""

    seq: int
    ranks: tuple[int, ...]


def next_roster(current: list[int], target: Target | None, joined: set[int], min_members: int = 1) -> list[int]:
    """The roster of the round after one whose roster is `current`: the target's ranks already in
    it, and the target's new ranks that have joined (loaded the state and said so). With no
    target, or while that would leave fewer than `min_members` (of the target's) — every later
    round would fail, and no new rank could ever be let in — the roster stays."""
    if target is None:
        return list(current)
    wanted = set(target.ranks)
    out = sorted({r for r in current if r in wanted} | {r for r in wanted if r not in current and r in joined})
    return out if len(out) >= max(1, min(min_members, len(wanted))) else list(current)


class Rosters:
    """Reads the launcher's newest target and who is there (`diloco.store.presence`: join and away
    markers) from one LIST (a GET when a newer target appears), and announces this replica."""

    def __init__(self, store: CountingStore, keys: RunKeys, run: str, log: Callable[[str], None]):
        self.store, self.keys, self.run, self.log = store, keys, run, log
        self.target: Target | None = None
        self._bad: set[str] = set()  # targets already found malformed (logged once)

    def look(self) -> tuple[Target | None, Presence]:
        """The newest well-formed target, and the presence markers."""
        names = self.store.list_names(self.keys.roster())
        presence = read_presence(names)
        scales = sorted(((seq, x) for x in names if (seq := scale_seq(x)) is not None and x not in self._bad),
                        reverse=True)
        for seq, name in scales:
            if self.target is not None and seq <= self.target.seq:
                break
            body = self.store.get(self.keys.roster() + name)
            if body is None:
                continue
            try:
                self.target = Target(seq, tuple(parse_roster(self.run, seq, body)))
                break
            except ValueError as exc:
                self._bad.add(name)
                self.log(f"ignoring {self.keys.roster()}{name}: {exc}")
        return self.target, presence

    def announce(self, rank: int, round_: int, incarnation: int) -> None:
        """This incarnation of this replica holds the global state and takes part from round
        `round_` on (`diloco.store.presence`)."""
        try:
            self.store.put(self.keys.join(rank, round_, incarnation), b"", create_only=True)
        except ObjectExists:  # announced before, the same words: as good
            pass
