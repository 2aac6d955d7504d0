"""Who is in a round: decided once, by the first create-only write, and never for a dead round.

A round waits until all N replicas are ready (their shards are up) or `round_timeout` passes,
then one replica's create-only ``members.json`` fixes the members for every shard; everyone
reads the winner's list. Fewer than `min_members` → `RoundFailed`. A replica that arrives after
the decision is not a member: its update is left out and it adopts the round's result.

History is never rewritten: a round at or below the store's low-water mark (see
`checkpoints.Checkpoints`) is gone or going, so a replica that has not seen it decided raises
`FellBehind` and rejoins from a checkpoint instead of deciding it again alone.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from diloco.store import ObjectExists

from .checkpoints import Checkpoints
from .rounderrors import FellBehind, RoundFailed
from .storeaccess import Backoff
from .wire import CorruptObject, Identity, pack_json, unpack

if TYPE_CHECKING:
    from .roundio import RoundIO


class Membership:
    def __init__(self, io: RoundIO, checkpoints: Checkpoints, *, min_members: int):
        self.store, self.keys, self.rank, self.n, self.checkpoints = io.store, io.keys, io.rank, io.n, checkpoints
        self.round_timeout, self.min_members = io.round_timeout, min_members
        self.poll_interval, self.poll_max, self.log = io.poll_interval, io.poll_max, io.log

    def read(self, r: int) -> list[int] | None:
        """The decided members of round r, or None if undecided (or deleted)."""
        key = self.keys.members(r)
        raw = self.store.get(key)
        if raw is None:
            return None
        try:
            got = unpack(raw, Identity(self.keys.run, r, "members"), key)
        except CorruptObject:
            raw = self.store.get(key)  # a torn read in transit heals on a second read; damage at rest does not
            if raw is None:
                return None
            got = unpack(raw, Identity(self.keys.run, r, "members"), key)
        members = got.meta.get("members")
        if not isinstance(members, list) or not members or not all(isinstance(m, int) and 0 <= m < self.n
                                                                   for m in members) or members != sorted(set(members)):
            raise CorruptObject(f"{key}: malformed membership record (members must be distinct ranks below {self.n})")
        return members

    def check_not_collected(self, r: int) -> None:
        """Raise FellBehind if round r is at or below the low-water mark (one LIST)."""
        mark = self.checkpoints.low_water()
        if r <= mark:
            raise FellBehind(f"round {r} is at or below the store's retained history (rounds ≤ {mark} were "
                             f"garbage-collected); this replica is too far behind")

    def decide(self, r: int) -> list[int]:
        """Wait for the others, then fix round r's members (or adopt whoever decided first)."""
        deadline = time.monotonic() + self.round_timeout
        backoff = Backoff(self.poll_interval, self.poll_max)
        prefix = self.keys.ready(r)
        waited = False  # the first LIST is the protocol's; every re-check after a wait is a poll
        while True:
            with self.store.polling(waited):
                ready = sorted(int(x) for x in self.store.list_names(prefix) if x.isdigit() and int(x) < self.n)
            if len(ready) == self.n:
                break
            with self.store.polling():
                decided = self.read(r) if len(ready) > 1 else None
            if decided is not None:
                return decided
            if not backoff.sleep(deadline):
                break
            waited = True
        if len(ready) < self.n:  # paused past the history (even our own ready marker went): rejoin
            self.check_not_collected(r)  # (with every marker there, this round is not collected)
        if len(ready) < self.min_members:
            raise RoundFailed(f"round {r}: only {len(ready)} of {self.n} replicas ready within "
                              f"{self.round_timeout:g}s, below min_members={self.min_members}")
        record = pack_json(Identity(self.keys.run, r, "members"), {"members": ready, "decided_by": self.rank})
        try:
            self.store.put(self.keys.members(r), record, create_only=True)
        except ObjectExists:
            return self.read(r) or ready
        if len(ready) < self.n:
            self.log(f"round {r}: proceeding with {len(ready)} of {self.n} replicas {ready} after "
                     f"{self.round_timeout:g}s")
        return ready
