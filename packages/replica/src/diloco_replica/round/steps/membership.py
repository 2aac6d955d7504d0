"""Who is in a round: decided once, by the first create-only write, and never for a dead round.

A round waits for the replicas of its roster (`roster`) it has reason to expect (`quorum`: the
last round's members, those announced for it, minus those the launcher saw end) until they are
ready (their pieces are up), or a grace window set from the run's pace passes; then one
replica's create-only ``members.json`` fixes the members for every shard, and says why each
absent rank is absent; everyone reads the winner's list. A ready marker's name carries its
replica's lane count and incarnation (``ready/<rank>.<lanes>.<incarnation>``: its attempt and
re-run, `diloco.store.presence.incarnation`) and the record keeps them beside each member, so every
reducer knows which pieces each member sent (`layout.Cut.pieces`) and everyone can tell when a
member's incarnation ended (`gather`). Fewer than `min_members` → `RoundFailed`. A replica that arrives after
the decision is not a member: its update is left out and it adopts the round's result.

History is never rewritten: a round at or below the store's low-water mark (see
`checkpoints.Checkpoints`) is gone or going, so a replica that has not seen it decided raises
`FellBehind` and rejoins from a checkpoint instead of deciding it again alone. Every decision
that leaves a rank of the roster out looks at the mark first (one LIST): a replica paused after
it found the round open may wake when the others have decided it, gone on and collected it, and
with nobody left to wait for it would otherwise decide it at once. (GC sets the mark before it
deletes, so only a collection begun and finished between that look and the write could slip by.)
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco.store.scaling import ranks_ok

from diloco.store.presence import MAX_INCARNATION, Presence

from ..checkpoints import Checkpoints
from ..layout import MAX_LANES
from .quorum import PERIODS, Absent, Verdict, expected, grace_seconds, verdict
from .roster import Rosters, next_roster
from ..errors import FellBehind, RoundFailed
from ..io import RoundIO
from ...transport.wire import CorruptObject, Identity, pack_json

PRESENCE_EVERY = 1.0  # seconds between re-reads of the presence markers while a round waits


class Membership:
    def __init__(self, io: RoundIO, checkpoints: Checkpoints, *, min_members: int, round_grace: float | None = None):
        self.io, self.checkpoints, self.min_members, self.round_grace = io, checkpoints, min_members, round_grace
        self.rosters = Rosters(io.store, io.keys, io.run_id, io.log)
        self._born = io.clock()  # the first round's period is counted from here
        self._ready_at: tuple[int, float] | None = None  # (round, when) this replica was last ready
        self.periods: list[float] = []  # its recent round periods, seconds
        self._decided: dict[int, Decided] = {}  # records read or written here, the newest few

    def read(self, r: int) -> Decided | None:
        """The decided members of round r, with their lane counts, or None if undecided (or deleted)."""
        if r in self._decided:
            return self._decided[r]
        io = self.io
        key = io.keys.members(r)
        got, problem = io.get_verified(key, Identity(io.run_id, r, "members"))
        if got is None:
            if problem == "missing":
                return None
            raise CorruptObject(problem)
        members, nxt = got.meta.get("members"), got.meta.get("next")
        for what, ranks in (("members", members), ("next", nxt)):
            if not ranks_ok(ranks):
                raise CorruptObject(f"{key}: malformed membership record ({what} must be distinct, ascending ranks)")
        lanes = got.meta.get("lanes")
        if not isinstance(lanes, list) or len(lanes) != len(members) or not all(
                type(k) is int and 1 <= k <= MAX_LANES for k in lanes):
            raise CorruptObject(f"{key}: malformed membership record (a lane count in 1..{MAX_LANES} per member)")
        incarnations = got.meta.get("incarnations")
        if not isinstance(incarnations, list) or len(incarnations) != len(members) or not all(
                type(a) is int and 0 <= a < MAX_INCARNATION for a in incarnations):
            raise CorruptObject(f"{key}: malformed membership record (an incarnation per member)")
        decided = self._decided[r] = Decided(members, lanes, nxt, incarnations)
        for old in [k for k in self._decided if k < r - 3]:
            del self._decided[old]
        return decided

    def decided_or_open(self, r: int, finished: tuple[int, float] | None) -> Decided | None:
        """Round r's record if already decided (this replica is late); None if it is open to join.
        `finished`: (round, when) this replica last completed a round.

        Skipped (two requests a round: a GET of members.json, a LIST of the low-water mark) when
        this replica finished round r − 1 less than round_timeout/2 ago: round r cannot have been
        collected since (history goes only after checkpoints of later rounds), and it was a
        member of r − 1, so the others expect it in round r and decide without it only a grace
        window after they were ready (`quorum`). Should they have (this replica's compute took
        a grace window longer than theirs), `decide` finds the record at its first look and the
        round's upload was all it cost.
        """
        if finished is not None and finished[0] == r - 1 and self.io.clock() - finished[1] < self.io.round_timeout / 2:
            return None
        decided = self.read(r)
        if decided is None:
            self.check_not_collected(r)
        return decided

    def check_not_collected(self, r: int) -> None:
        """Raise FellBehind if round r is at or below the low-water mark (one LIST)."""
        mark = self.checkpoints.low_water()
        if r <= mark:
            raise FellBehind(f"round {r} is at or below the store's retained history (rounds ≤ {mark} were "
                             f"garbage-collected); this replica is too far behind")

    def grace(self) -> float:
        """How long this replica, once ready, waits for expected replicas that are not (`quorum`)."""
        return grace_seconds(self.periods, round_timeout=self.io.round_timeout, setting=self.round_grace)

    def _pace(self, r: int) -> None:
        """Note when this replica became ready for round r: its round period (`quorum.grace_seconds`)."""
        now = self.io.clock()
        if self._ready_at is None or self._ready_at[0] == r - 1:
            self.periods = (self.periods + [now - (self._ready_at[1] if self._ready_at else self._born)])[-PERIODS:]
        self._ready_at = (r, now)

    def _expected(self, r: int, roster: list[int], last_roster: list[int] | None,
                  presence: Presence) -> tuple[set[int], set[int], set[int]]:
        """(expected, away, rejoining later) ranks of round r (`quorum.expected`)."""
        away = {k for k in roster if presence.is_away(k)}
        later = {k for k in roster if presence.waits_for_later(k, r)}
        last = self.read(r - 1) if r > 1 else None
        if r > 1 and last is None:  # the round before is gone from the store: expect everyone but those
            return set(roster) - away - later, away, later
        announced = {k for k in roster if presence.announced(k, r)}
        return expected(roster, first=r == 1, last_members=last.members if last else [],
                        last_roster=last_roster or roster, announced=announced, away=away,
                        later=later), away, later

    def decide(self, r: int, roster: list[int], last_roster: list[int] | None = None) -> Decided:
        """Wait for the expected replicas of round r's `roster` (`quorum`), then fix its members and
        the next round's roster (`roster.next_roster`), or adopt whoever decided first.
        `last_roster`: round r − 1's (who this round lets in for the first time)."""
        io = self.io
        self._pace(r)
        # The verdict, not the poll's deadline, ends this wait: past round_timeout it closes or fails, so
        # the poll looks once more at its deadline (`final_look`). Its clock stands still while the store
        # is away: an outage is waited for, not timed out.
        poll = io.poll(f"round {r}'s ready markers", final_look=True)
        start = poll.started
        grace = self.grace()
        prefix = io.keys.ready(r)
        target, presence = self.rosters.look()
        looked = start
        expect, away, later = self._expected(r, roster, last_roster, presence)
        for look in poll:
            with io.store.polling(look > 0):  # the first LIST is the protocol's; every re-check after a wait is a poll
                lanes_of = ready_markers(io.store.list_names(prefix), roster)
            ready = set(lanes_of)
            got = verdict(ready, roster, expect, waited=io.clock() - start, grace=grace,
                          round_timeout=io.round_timeout, min_members=self.min_members)
            if got is not Verdict.WAIT:
                break
            with io.store.polling():
                decided = self.read(r) if len(ready) > 1 else None
            if decided is not None:
                return decided
            if io.clock() - looked >= PRESENCE_EVERY:  # the launcher may have seen one end meanwhile
                with io.store.polling():
                    target, presence = self.rosters.look()
                looked = io.clock()
                expect, away, later = self._expected(r, roster, last_roster, presence)
        if len(ready) < len(roster):  # the others may have decided this round without us long ago, and
            self.check_not_collected(r)  # its record gone with the history: never decide it again (rejoin)
        if got is Verdict.FAIL:
            raise RoundFailed(f"round {r}: only {len(ready)} of {len(roster)} replicas ready within "
                              f"{io.round_timeout:g}s, below min_members={self.min_members}")
        members = sorted(ready)
        decided = Decided(members, [lanes_of[m][0] for m in members],
                          next_roster(roster, target, presence.joined(), self.min_members),
                          [lanes_of[m][1] for m in members])
        absent = Absent.of(roster, ready, expect, away, later)
        record = pack_json(Identity(io.run_id, r, "members"), {
            "members": members, "lanes": decided.lanes, "next": decided.next, "incarnations": decided.incarnations,
            "decided_by": io.rank,
            "absent": {str(a.rank): a.why for a in absent}})
        if not io.put(io.keys.members(r), record, create_only=True):
            return self.read(r) or decided
        self._decided[r] = decided
        if absent:
            io.log(f"round {r}: proceeding with {len(members)} of {len(roster)} replicas {members} after "
                   f"{io.clock() - start:.1f}s (" + ", ".join(f"{a.rank}: {a.why}" for a in absent) + ")")
        if decided.next != roster:
            io.log(f"round {r}: the next round's replicas are {decided.next} (were {roster})")
        return decided


@dataclass(frozen=True)
class Decided:
    """A round's members (ranks, ascending), each one's lane count and incarnation in the same
    order, and the next round's roster (`roster`)."""

    members: list[int]
    lanes: list[int]
    next: list[int]
    incarnations: list[int]

    @property
    def layouts(self) -> dict[int, int]:
        return dict(zip(self.members, self.lanes))

    @property
    def incarnations_of(self) -> dict[int, int]:
        return dict(zip(self.members, self.incarnations))

    def to_json(self) -> list:
        return [self.members, self.lanes, self.next, self.incarnations]

    @classmethod
    def from_json(cls, value: list) -> Decided:
        return cls(list(value[0]), list(value[1]), list(value[2]), list(value[3]))


def ready_markers(names: list[str], roster: list[int]) -> dict[int, tuple[int, int]]:
    """rank -> (lane count, incarnation) from ready markers' names (``<rank>.<lanes>.<incarnation>``)
    of the round's roster; anything else is ignored, and a rank named twice counts with its fewest
    lanes and newest incarnation."""
    out: dict[int, tuple[int, int]] = {}
    expected = set(roster)
    for name in names:
        parts = name.split(".")
        if len(parts) != 3 or not all(p.isdigit() and len(p) <= 12 for p in parts):
            continue
        rank, lanes, inc = (int(p) for p in parts)
        if rank in expected and 1 <= lanes <= MAX_LANES and inc < MAX_INCARNATION:
            had = out.get(rank, (MAX_LANES, -1))
            out[rank] = (min(lanes, had[0]), max(inc, had[1]))
    return out
