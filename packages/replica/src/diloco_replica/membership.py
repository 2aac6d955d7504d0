"""Who is in a round: decided once, by the first create-only write, and never for a dead round.

A round waits until all N replicas of its roster (`roster`) are ready (their pieces are up) or
`round_timeout` passes,
then one replica's create-only ``members.json`` fixes the members for every shard; everyone
reads the winner's list. A ready marker's name carries its replica's lane count
(``ready/<rank>.<lanes>``) and the record keeps it beside each member, so every reducer knows
which pieces each member sent (`layout.Cut.pieces`). Fewer than `min_members` → `RoundFailed`. A replica that arrives after
the decision is not a member: its update is left out and it adopts the round's result.

History is never rewritten: a round at or below the store's low-water mark (see
`checkpoints.Checkpoints`) is gone or going, so a replica that has not seen it decided raises
`FellBehind` and rejoins from a checkpoint instead of deciding it again alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from diloco.scaling import ranks_ok

from .checkpoints import Checkpoints
from .layout import MAX_LANES
from .roster import Rosters, next_roster
from .rounderrors import FellBehind, RoundFailed
from .roundio import RoundIO
from .wire import CorruptObject, Identity, pack_json


class Membership:
    def __init__(self, io: RoundIO, checkpoints: Checkpoints, *, min_members: int):
        self.io, self.checkpoints, self.min_members = io, checkpoints, min_members
        self.rosters = Rosters(io.store, io.keys, io.run_id, io.log)

    def read(self, r: int) -> Decided | None:
        """The decided members of round r, with their lane counts, or None if undecided (or deleted)."""
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
        return Decided(members, lanes, nxt)

    def check_not_collected(self, r: int) -> None:
        """Raise FellBehind if round r is at or below the low-water mark (one LIST)."""
        mark = self.checkpoints.low_water()
        if r <= mark:
            raise FellBehind(f"round {r} is at or below the store's retained history (rounds ≤ {mark} were "
                             f"garbage-collected); this replica is too far behind")

    def decide(self, r: int, roster: list[int]) -> Decided:
        """Wait for the replicas of round r's `roster`, then fix its members and the next round's
        roster (`roster.next_roster`), or adopt whoever decided first."""
        io, n = self.io, len(roster)
        deadline = time.monotonic() + io.round_timeout
        backoff = io.backoff()
        prefix = io.keys.ready(r)
        waited = False  # the first LIST is the protocol's; every re-check after a wait is a poll
        while True:
            with io.store.polling(waited):
                lanes_of = ready_markers(io.store.list_names(prefix), roster)
            ready = sorted(lanes_of)
            if len(ready) == n:
                break
            with io.store.polling():
                decided = self.read(r) if len(ready) > 1 else None
            if decided is not None:
                return decided
            if not backoff.sleep(deadline):
                break
            waited = True
        if len(ready) < n:  # paused past the history (even our own ready marker went): rejoin
            self.check_not_collected(r)  # (with every marker there, this round is not collected)
        if len(ready) < self.min_members:
            raise RoundFailed(f"round {r}: only {len(ready)} of {n} replicas ready within "
                              f"{io.round_timeout:g}s, below min_members={self.min_members}")
        target, joined = self.rosters.look()
        decided = Decided(ready, [lanes_of[m] for m in ready], next_roster(roster, target, joined, self.min_members))
        record = pack_json(Identity(io.run_id, r, "members"), {"members": ready, "lanes": decided.lanes,
                                                               "next": decided.next, "decided_by": io.rank})
        if not io.put(io.keys.members(r), record, create_only=True):
            return self.read(r) or decided
        if len(ready) < n:
            io.log(f"round {r}: proceeding with {len(ready)} of {n} replicas {ready} after "
                   f"{io.round_timeout:g}s")
        if decided.next != roster:
            io.log(f"round {r}: the next round's replicas are {decided.next} (were {roster})")
        return decided


@dataclass(frozen=True)
class Decided:
    """A round's members (ranks, ascending), each one's lane count in the same order, and the
    next round's roster (`roster`)."""

    members: list[int]
    lanes: list[int]
    next: list[int]

    @property
    def layouts(self) -> dict[int, int]:
        return dict(zip(self.members, self.lanes))

    def to_json(self) -> list:
        return [self.members, self.lanes, self.next]

    @classmethod
    def from_json(cls, value: list) -> Decided:
        return cls(list(value[0]), list(value[1]), list(value[2]))


def ready_markers(names: list[str], roster: list[int]) -> dict[int, int]:
    """rank -> lane count from ready markers' names (``<rank>.<lanes>``) of the round's roster;
    anything else is ignored, and a rank named twice counts with its fewest lanes."""
    out: dict[int, int] = {}
    expected = set(roster)
    for name in names:
        rank, _, lanes = name.partition(".")
        if rank.isdigit() and lanes.isdigit() and int(rank) in expected and 1 <= int(lanes) <= MAX_LANES:
            out[int(rank)] = min(int(lanes), out.get(int(rank), MAX_LANES))
    return out
