"""Repairs: a reduced shard found corrupt in the store is re-published by its reducer.

A reducer keeps the bytes it published until its next round is formed (in a local file:
`keptparts`). A reader that finds a reduced shard corrupt (twice: a torn transfer heals on a
second read, damage at rest does not) leaves a request, ``r/repair/j``, and waits for
``r/repaired/j``; the reducer answers with the very bytes it first wrote, which the reader
verifies the same way. Races with retention end in "use the published result" or `FellBehind`
(rejoin), never in an exception that costs a restart.

When the reducer looks is event-driven, not a continuous watch: a reader stuck on a corrupt
shard holds up the next round, so the reducer meets it while it waits itself — for the next
round's members, for reduced shards, or for a repair of its own — and looks then (`waiting()`),
at most once every `REPAIR_LOOK_EVERY` seconds (polls, counted as `repair_looks`); and once when
the next round is formed. A reader waits one round timeout for the repair, and more while the
reducer's incarnation is live (`REPAIR_WINDOWS`): nobody else can reduce that shard to the bits its
reducer applied (its own piece never left it).

A reducer that is *gone* (the launcher marked its incarnation away, or a later incarnation of it
joined, or is this very replica replaying its own round) holds those bits no more, and a replica
that replays the round cannot get them either, so waiting or failing would only loop. The
shard's update is *voided* instead: the first reader to find the reducer gone writes, create-only
at the re-publication's own key, a zero mean marked `void` (and voids the round's checkpoint,
whose piece of that shard the reducer may have written from the mean it applied). Either the
reducer's re-publication or the void is there, never both, and every reader and replayer applies
whichever it is: the round's update of that shard is a zero pseudo-gradient on every replica (the
outer momentum still moves it), so θ_global stays one. Never voided: a shard someone took over
(``claim/``: its live claimant may hold the mean), or one whose round a complete checkpoint at
or after it already holds (only the reducer could have written it, with the real mean: readers
rejoin from there instead). A platform that re-runs an attempt without numbering the runs
(SageMaker's managed spot) leaves the reducer's incarnation unchanged, so there a gone reducer is
only waited for (`REPAIR_WINDOWS`), as before. Between rounds it also looks 1, 3, 7, 15, … seconds after its own
round ended (`look_soon`, the gap doubling): a reader that asks t seconds after that is served
within another t at most, so within its round timeout whenever it asked within it, while a
healthy inner phase of T seconds costs about log2(T) LISTs, not one every few seconds (~20 a
round on S3 before).

"Corrupt" is anything a reader cannot use: a bad checksum, an object that does not fit the
round's layout (shard length, codec), non-finite values (a reducer never publishes them), or a
malformed record of who was left out. Every reader also collects that record (`nonfinite`), so a
replica learns when its own update was left out for NaN/Inf values.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ...transport.finite import all_finite
from .keptparts import KeptParts
from .membership import Membership
from ..errors import FellBehind, RoundFailed
from ..io import RoundIO
from ..state import Round
from .roster import MAX_RANK
from ..storeaccess import reducer_of
from ...transport.wire import CorruptObject, Unpacked, encode_tensor, pack

# While a reducer waits, it looks for repair requests at most this often (and at the store's
# poll_max, if longer): a stuck reader is served within about a second of the reducer's next wait.
REPAIR_LOOK_EVERY = 1.0

# A reader waits for a repair one round timeout at a time, while the reducer's incarnation is live, up
# to this many in all: only that reducer holds the mean it applied (its own piece of the shard never
# left it, so nobody else can reduce the shard to the same bits), so a reducer paused past one round
# timeout is waited for, not answered with restarts that would wait for it all the same.
REPAIR_WINDOWS = 8

# What became of a round's reducer (`RepairDesk._writer_state`).
GONE, LIVE, UNKNOWN = "gone", "live", "unknown"


class RepairDesk:
    """Reads reduced shards (asking for a repair when one is corrupt) and serves repairs of the
    shards this replica published."""

    def __init__(self, io: RoundIO, membership: Membership, *, incarnation: int = 0):
        self.io, self.membership, self.incarnation = io, membership, incarnation  # this replica's own
        self.published = KeptParts(io.log)  # shard -> (round, blob) this replica last reduced
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._lock = threading.Lock()
        self._starting = threading.Lock()  # one watcher, however many reducing threads ask
        self._waiters = 0
        self._waiting = threading.Event()  # set while this replica waits in the store protocol
        self._look_at: float | None = None  # the next look after a round ended (readers behind it)
        self._look_gap = REPAIR_LOOK_EVERY  # and the gap before the one after, doubling

    # -- reading -----------------------------------------------------------------------------

    def read_reduced(self, rnd: Round, j: int) -> torch.Tensor:
        """Shard j's published mean, verified; a corrupt one is replaced by its reducer's
        re-publication (an incident of `rnd`). `rnd.nonfinite` gathers whom the reducer left out
        for NaN/Inf."""
        return self._read(rnd.r, j, rnd.size(j), rnd.roster, rnd.members, rnd.incidents, rnd.nonfinite)

    def _read(self, r: int, j: int, numel: int, roster: list[int], members: list[int] | None,
              incidents: list[dict[str, Any]], nonfinite: set[int]) -> torch.Tensor:
        io = self.io
        obj, problem = io.get_reduced(r, j, numel)
        key = io.keys.reduced(r, j)
        if obj is not None:
            try:
                return self._usable(obj, nonfinite)
            except CorruptObject as exc:
                problem = str(exc)
        elif problem == "missing":
            self.membership.check_not_collected(r)  # deleted by retention: rejoin
            raise RoundFailed(f"{key} vanished")
        return self._repaired(r, j, key, numel, problem, roster, members, incidents, nonfinite)

    def _usable(self, obj: Unpacked, nonfinite: set[int] | None) -> torch.Tensor:
        """A verified reduced shard's values, if they are finite and its left-out record is well-formed."""
        mean = obj.tensor()
        if not all_finite(mean):
            raise CorruptObject(f"{obj.key}: non-finite values in a reduced shard (no reducer publishes them)")
        flagged = obj.meta.get("nonfinite", [])
        if not isinstance(flagged, list) or not all(type(m) is int and 0 <= m < MAX_RANK for m in flagged):
            raise CorruptObject(f"{obj.key}: malformed record of non-finite contributions")
        if nonfinite is not None:
            nonfinite.update(flagged)
        return mean

    def _repaired(self, r: int, j: int, key: str, numel: int, problem: str, roster: list[int],
                  members: list[int] | None,
                  incidents: list[dict[str, Any]], nonfinite: set[int]) -> torch.Tensor:
        io = self.io
        if not members:
            decided = self.membership.read(r)
            members = decided.members if decided is not None else []
        writer = reducer_of(j, members, roster) if members else None
        io.log(f"round {r}: {problem}; asking its reducer (rank {writer}) to re-publish it")
        io.put(io.keys.repair(r, j), json.dumps({"by": io.rank, "problem": problem}).encode(),
               create_only=True)
        with self.waiting():
            return self._await_repair(r, j, key, numel, problem, writer, incidents, nonfinite)

    def _await_repair(self, r: int, j: int, key: str, numel: int, problem: str, writer: int | None,
                      incidents: list[dict[str, Any]], nonfinite: set[int]) -> torch.Tensor:
        io = self.io
        windows = 0

        def another_window() -> bool:
            """The deadline passed: void the shard's update if its reducer is gone; wait again while
            the reducer's incarnation is live (paused or slow), at most REPAIR_WINDOWS round timeouts
            in all; else fail the round."""
            nonlocal windows
            self.membership.check_not_collected(r)
            windows += 1
            state = self._writer_state(r, writer) if writer is not None else UNKNOWN
            if state == GONE and not self._claimed(r, j):
                self._void(r, j, numel, writer, problem)
                return True  # the next look reads the void, or the re-publication that beat it
            if windows < REPAIR_WINDOWS and state == LIVE:
                io.log(f"round {r}: rank {writer} has not re-published {key} in {windows * io.round_timeout:g}s "
                       f"but its incarnation is live (paused or slow); waiting for it")
                return True
            raise RoundFailed(f"{key} is corrupt ({problem}) and its reducer (rank {writer}) did not re-publish "
                              f"it within {windows * io.round_timeout:g}s")

        for look in io.poll(f"{key} re-published", extend=another_window):
            with io.store.polling(look > 0):  # every look after the first is a poll
                obj, again = io.get_reduced(r, j, numel, repaired=True)
            if obj is None and again != "missing":  # re-published create-only, as read twice: it stays so
                raise RoundFailed(f"{key} is corrupt ({problem}) and so is its re-publication: {again}")
            if obj is not None:
                try:
                    mean = self._usable(obj, nonfinite)
                except CorruptObject as exc:  # re-published create-only: it will not get better
                    raise RoundFailed(f"{key} is corrupt ({problem}) and so is its re-publication: {exc}") from None
                void = obj.meta.get("void") is True
                if void and (mean.any() or obj.meta.get("nonfinite")):
                    raise RoundFailed(f"{io.keys.repaired(r, j)} says the shard's update is void but holds values")
                incidents.append({"round": r, "object": key, "writer": writer, "problem": problem, "action": (
                    f"voided: its reducer (rank {writer}) is gone, and with it the only copy of the mean; the "
                    f"round's update of this shard is a zero pseudo-gradient on every replica" if void else
                    f"re-published by its reducer as {io.keys.repaired(r, j)}")})
                if void:
                    io.log(f"round {r}: {key} is corrupt ({problem}) and its reducer (rank {writer}) is gone: "
                           f"the shard's update is void (zero) on every replica")
                return mean
        raise AssertionError("a repair wait ends by returning or raising")  # `another_window` raises at the end

    def _claimed(self, r: int, j: int) -> bool:
        """Whether someone took shard j of round r over (a claim in ``claim/``; one LIST, a poll):
        then its publisher may be that live claimant, and nothing is voided under it."""
        with self.io.store.polling():
            names = self.io.store.list_names(f"{self.io.keys.round(r)}/claim/")
        return any(name.split(".", 1)[0] == str(j) for name in names)

    def _void(self, r: int, j: int, numel: int, writer: int, problem: str) -> None:
        """Void shard j's update of round r (see the module): round r's checkpoint first, then a
        zero mean marked `void` at the re-publication's key, create-only (a re-publication that
        came first stands)."""
        io = self.io
        if io.exists(io.keys.repaired(r, j)):
            return  # re-published (or voided) meanwhile: the next look reads it
        held = [c for c in self.membership.checkpoints.complete() if c >= r]
        if held:  # only the reducer can have completed it (every other member waits here): with the real mean
            raise FellBehind(f"round {r}: reduced shard {j} is corrupt and its reducer (rank {writer}) is gone, but "
                             f"checkpoint {held[-1]} holds the round; rejoining from it")
        why = f"reduced shard {j} of round {r} is corrupt ({problem}) and its reducer (rank {writer}) is gone"
        self.membership.checkpoints.void([r], why)
        blob = pack(io.reduced_identity(r, j), encode_tensor(torch.zeros(numel), io.codec), codec=io.codec,
                    numel=numel, meta={"void": True, "by": io.rank, "reducer": writer, "nonfinite": []})
        io.put(io.keys.repaired(r, j), blob, create_only=True)

    def _writer_state(self, r: int, writer: int) -> str:
        """What became of the incarnation that reduced round r's shard (one GET of each of the two
        rounds' records unless held, one LIST of the presence markers, a poll):
        `GONE`, ended for certain: the launcher marked it away, a later incarnation of the rank
        announced itself, or it is this very replica's earlier one (replaying its own round);
        `LIVE`, it may still answer: none of that, and it has not moved on past the round (a
        member of round r + 1, or announced for a round after that: then it forgot what it
        published, `next_round`); `UNKNOWN` otherwise, a missing or damaged record included:
        nothing is voided on a guess. Without a launcher to mark it away, a dead reducer reads
        as live: the wait is bounded by `REPAIR_WINDOWS`."""
        try:
            decided = self.membership.read(r)
        except CorruptObject:  # a damaged record says nothing about the reducer
            return UNKNOWN
        incarnation = decided.incarnations_of.get(writer) if decided is not None else None
        if incarnation is None:
            return UNKNOWN
        if writer == self.io.rank and incarnation < self.incarnation:  # this replica, replaying its own round
            return GONE
        with self.io.store.polling():
            presence = self.membership.rosters.look()[1]
        joined = presence.joins.get(writer)
        if presence.away.get(writer, -1) >= incarnation or (joined is not None and joined[0] > incarnation):
            return GONE
        try:
            after = self.membership.read(r + 1)
        except CorruptObject:
            return UNKNOWN
        if after is not None and after.incarnations_of.get(writer) == incarnation:
            return UNKNOWN
        if joined is not None and joined[0] == incarnation and any(k > r + 1 for k in joined[1]):
            return UNKNOWN
        return LIVE

    # -- serving -----------------------------------------------------------------------------

    def publish(self, r: int, j: int, blob: list) -> None:
        """Keep what this replica published for shard j of round r, to re-publish it if asked, and
        watch for such requests until the next round (a reader may find it corrupt while this
        replica still gathers)."""
        self.published.keep(r, j, blob)
        self._watch()

    def serve_once(self) -> bool:
        """Re-publish shards readers found corrupt (one LIST per round); True once nothing is left."""
        io = self.io
        for r, shards in self.published.by_round().items():
            asked = io.present(io.keys.repair(r))
            for j in shards:
                if j in asked:  # the very bytes it published first: readers verify them the same way
                    io.put(io.keys.repaired(r, j), self.published.take(j), create_only=True)
                    io.log(f"round {r}: re-published reduced shard {j} (a reader found it corrupt)")
        return not self.published

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """This replica waits in the store protocol: a reader stuck on its shard may be why."""
        with self._lock:
            self._waiters += 1
            self._waiting.set()
        try:
            yield
        finally:
            with self._lock:
                self._waiters -= 1
                if not self._waiters:
                    self._waiting.clear()

    def _watch(self) -> None:
        """Until the next round is formed, answer repair requests whenever this replica waits
        (after each publication, from the threads reducing a round's parts)."""
        with self._starting:
            if self._watcher is None or not self._watcher.is_alive():
                self._start_watch()

    def _start_watch(self) -> None:
        io = self.io
        self._stop = threading.Event()
        stop, every = self._stop, max(REPAIR_LOOK_EVERY, io.poll_max)

        def watch() -> None:
            while not stop.is_set():
                due = self._look_at is not None and time.monotonic() >= self._look_at
                if not (self._waiting.wait(0.05) or due) or stop.is_set():
                    continue
                if due:
                    self._look_at, self._look_gap = time.monotonic() + self._look_gap, 2 * self._look_gap
                try:
                    with io.store.polling(repair=True):  # a look costs what the wait costs: polls
                        if self.serve_once() and self._retire():
                            return
                except Exception as exc:  # never let the watcher take the replica down
                    io.log(f"repair watch failed: {exc}")
                stop.wait(every)  # waiting on the event, not sleeping: the next round stops it at once

        self._watcher = threading.Thread(target=watch, name="diloco-repairs", daemon=True)
        self._watcher.start()

    def _retire(self) -> bool:
        """Whether the watcher may end: nothing published is left to serve. Decided under the lock
        `_watch()` starts watchers under, so a part published meanwhile (the reducing threads publish
        part by part, each publication starting a watcher if none runs) is never left without one."""
        with self._starting:
            if self.published:
                return False
            self._watcher = None
            return True

    def look_soon(self) -> None:
        """This replica's round is done: look a moment from now for readers behind it, then at
        doubling gaps until the next round (the last round of a run has no next round to wait in)."""
        first = max(REPAIR_LOOK_EVERY, self.io.poll_max)
        self._look_at, self._look_gap = time.monotonic() + first, 2 * first

    def next_round(self) -> None:
        """A new round is formed: stop watching, answer late requests once, forget what was published."""
        self.stop()
        if self.published:
            self.serve_once()  # late requests (e.g. from a replaying rejoiner)
        self.published.clear()

    def close(self) -> None:
        """The replica leaves: answer the requests already made, then stop."""
        self.stop()
        if self.published:
            try:
                self.serve_once()
            except Exception as exc:  # leaving anyway; a reader that waits rejoins
                self.io.log(f"repair watch failed: {exc}")
        self.published.close()

    def stop(self) -> None:
        self._stop.set()
        watcher = self._watcher  # a retiring watcher clears the field itself
        if watcher is not None:
            watcher.join()
        self._watcher = None
