"""Repairs: a reduced shard found corrupt in the store is re-published by its reducer.

A reducer keeps the bytes it published until its next round is formed. A reader that finds a
reduced shard corrupt (twice: a torn transfer heals on a second read, damage at rest does not)
asks with ``r/repair/j`` and waits for ``r/repaired/j``; the reducer's watch thread, polling
with a backoff capped at `REPAIR_POLL_CAP`, answers with the very bytes it first wrote, which the
reader verifies the same way. Races with retention end in "use the published result" or
`FellBehind` (rejoin), never in an exception that costs a restart.

"Corrupt" is anything a reader cannot use: a bad checksum, an object that does not fit the
round's layout (shard length, codec), non-finite values (a reducer never publishes them), or a
malformed record of who was left out. Every reader also collects that record (`nonfinite`), so a
replica learns when its own update was left out for NaN/Inf values.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import torch

from .finite import all_finite
from .membership import Membership, RoundFailed
from .roundio import RoundIO
from .storeaccess import reducer_of
from .wire import CorruptObject, Identity, Unpacked

# A reducer watches for repair requests for round_timeout after publishing, backing off to one LIST
# per 30 s: ~20 LISTs a round on S3 for a fault that is rare; a reader asking waits at most that long.
REPAIR_POLL_CAP = 30.0


class RepairDesk:
    """Reads reduced shards (asking for a repair when one is corrupt) and serves repairs of the
    shards this replica published."""

    def __init__(self, io: RoundIO, membership: Membership):
        self.io, self.membership = io, membership
        self.published: dict[int, tuple[int, list]] = {}  # shard -> (round, blob) this replica last reduced
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    # -- reading -----------------------------------------------------------------------------

    def published_or_none(self, r: int, j: int, numel: int, nonfinite: set[int] | None = None) -> torch.Tensor | None:
        if self.io.store.get(self.io.keys.reduced(r, self.io.sid(j))) is None:
            return None
        return self.read_reduced(r, j, numel, None, [], nonfinite)

    def read_reduced(self, r: int, j: int, numel: int, members: list[int] | None, incidents: list[dict[str, Any]],
                     nonfinite: set[int] | None = None) -> torch.Tensor:
        """Shard j's published mean (`numel` values), verified; a corrupt one is replaced by its
        reducer's re-publication. `nonfinite` gathers whom the reducer left out for NaN/Inf."""
        io = self.io
        ident = Identity(io.run_id, r, "reduced", io.sid(j), -1)
        key = io.keys.reduced(r, io.sid(j))
        obj, problem = io.get_verified(key, ident, numel=numel, codec=io.codec)
        if obj is not None:
            try:
                return self._usable(obj, nonfinite)
            except CorruptObject as exc:
                problem = str(exc)
        elif problem == "missing":
            self.membership.check_not_collected(r)  # deleted by retention: rejoin
            raise RoundFailed(f"{key} vanished")
        return self._repaired(r, j, key, numel, problem, members, incidents, nonfinite)

    def _usable(self, obj: Unpacked, nonfinite: set[int] | None) -> torch.Tensor:
        """A verified reduced shard's values, if they are finite and its left-out record is well-formed."""
        mean = obj.tensor()
        if not all_finite(mean):
            raise CorruptObject(f"{obj.key}: non-finite values in a reduced shard (no reducer publishes them)")
        flagged = obj.meta.get("nonfinite", [])
        if not isinstance(flagged, list) or not all(isinstance(m, int) and 0 <= m < self.io.n for m in flagged):
            raise CorruptObject(f"{obj.key}: malformed record of non-finite contributions")
        if nonfinite is not None:
            nonfinite.update(flagged)
        return mean

    def _repaired(self, r: int, j: int, key: str, numel: int, problem: str, members: list[int] | None,
                  incidents: list[dict[str, Any]], nonfinite: set[int] | None) -> torch.Tensor:
        io = self.io
        ident = Identity(io.run_id, r, "reduced", io.sid(j), -1)
        members = members or self.membership.read(r) or []
        writer = reducer_of(j, members) if members else None
        io.log(f"round {r}: {problem}; asking its reducer (rank {writer}) to re-publish it")
        io.put(io.keys.repair(r, io.sid(j)), json.dumps({"by": io.rank, "problem": problem}).encode(),
               create_only=True)
        deadline = time.monotonic() + io.round_timeout
        backoff = io.backoff()
        while True:
            obj, _ = io.get_verified(io.keys.repaired(r, io.sid(j)), ident, numel=numel, codec=io.codec)
            if obj is not None:
                try:
                    mean = self._usable(obj, nonfinite)
                except CorruptObject as exc:  # re-published create-only: it will not get better
                    raise RoundFailed(f"{key} is corrupt ({problem}) and so is its re-publication: {exc}") from None
                incidents.append({"round": r, "object": key, "writer": writer, "problem": problem,
                                  "action": f"re-published by its reducer as {io.keys.repaired(r, io.sid(j))}"})
                return mean
            if not backoff.sleep(deadline):
                self.membership.check_not_collected(r)
                raise RoundFailed(f"{key} is corrupt ({problem}) and its reducer (rank {writer}) did not re-publish "
                                  f"it within {io.round_timeout:g}s")

    # -- serving -----------------------------------------------------------------------------

    def serve_once(self) -> bool:
        """Re-publish shards readers found corrupt; True once nothing is left to watch."""
        io = self.io
        by_round: dict[int, list[int]] = {}
        for j, (r, _) in self.published.items():
            by_round.setdefault(r, []).append(j)
        for r, shards in by_round.items():
            asked = io.present(io.keys.repair(r))
            for j in shards:
                if j in asked:  # the very bytes it published first: readers verify them the same way
                    _, blob = self.published.pop(j)
                    io.put(io.keys.repaired(r, io.sid(j)), blob, create_only=True)
                    io.log(f"round {r}: re-published reduced shard {j} (a reader found it corrupt)")
        return not self.published

    def watch(self, r: int) -> None:
        """Until the next round is formed (or the timeout), answer repair requests for round r."""
        io = self.io
        self._stop = threading.Event()
        stop = self._stop

        def watch() -> None:
            deadline = time.monotonic() + io.round_timeout
            delay = max(io.poll_interval, 0.05)
            while True:
                try:
                    with io.store.polling():  # a watch costs what the wait costs: polls
                        if self.serve_once():
                            return
                except Exception as exc:  # never let the watcher take the replica down
                    io.log(f"round {r}: repair watch failed: {exc}")
                remaining = deadline - time.monotonic()
                # waiting on the event, not sleeping: the next round stops the watch at once
                if remaining <= 0 or stop.wait(min(delay, remaining)):
                    return
                delay = min(delay * 1.5, max(io.poll_max, REPAIR_POLL_CAP))

        self._watcher = threading.Thread(target=watch, name=f"diloco-repairs-r{r}", daemon=True)
        self._watcher.start()

    def next_round(self) -> None:
        """A new round is formed: stop watching, answer late requests once, forget what was published."""
        self.stop()
        self.serve_once()  # late requests (e.g. from a replaying rejoiner)
        self.published.clear()

    def stop(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join()
            self._watcher = None
