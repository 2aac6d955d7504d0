"""The store as the round protocol uses it: counted requests, paced waiting, and key names.

Everything above this module addresses objects through `RunKeys` and moves them through
`CountingStore`, so bytes and requests per round are measured in one place and the layout is
written down once.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

from diloco.presence import join_name
from diloco.store import Store

from diloco.wiresize import Traffic


class CountingStore:
    """Wraps the run's store; counts every byte and request made through it.

    Requests made inside `polling()` are also counted as polls: re-checks while waiting for
    other replicas, whose number depends on how long the wait was, not on the protocol (the
    estimate in `diloco.estimate` predicts the rest exactly).
    """

    def __init__(self, store: Store):
        self.store = store
        self.traffic = Traffic()
        self._local = threading.local()

    @contextmanager
    def polling(self, active: bool = True, *, repair: bool = False):
        """Requests inside are polls; `repair`: a reducer's look for repair requests, too."""
        before = getattr(self._local, "polling", False)
        self._local.polling = "repair" if active and repair else active
        try:
            yield
        finally:
            self._local.polling = before

    def _count_poll(self) -> None:
        kind = getattr(self._local, "polling", False)
        if kind:
            self.traffic.polls += 1
            if kind == "repair":
                self.traffic.repair_looks += 1

    @property
    def uri(self) -> str:
        return self.store.uri

    def put(self, key: str, data: bytes | list[bytes | memoryview], *, create_only: bool = False) -> None:
        self.traffic.puts += 1
        parts = data if isinstance(data, list) else [data]
        self.traffic.bytes_up += sum(memoryview(x).nbytes for x in parts)
        self.store.put(key, data, create_only=create_only)

    def get(self, key: str) -> memoryview | None:
        self.traffic.gets += 1
        self._count_poll()
        data = self.store.get(key)
        if data is not None:
            self.traffic.bytes_down += data.nbytes
        return data

    def list(self, prefix: str, *, offset: str | None = None):
        self.traffic.lists += 1
        self._count_poll()
        return list(self.store.list(prefix, offset=offset))

    def list_names(self, prefix: str) -> list[str]:
        """Object names under `prefix`, relative to it."""
        self.traffic.lists += 1
        self._count_poll()
        return [m["path"][len(prefix):] for m in self.store.list(prefix)]

    def list_dirs(self, prefix: str) -> list[str]:
        self.traffic.lists += 1
        self._count_poll()
        return self.store.list_dirs(prefix)

    def delete(self, key: str) -> None:
        self.traffic.deletes += 1
        self.store.delete(key)

    def delete_many(self, keys: list[str]) -> None:
        """Delete `keys`, counted as the requests the store bills: one per bulk batch where it
        has bulk delete (S3, Azure), one per key elsewhere."""
        if not keys:
            return
        batch = getattr(self.store, "bulk_delete", 1)
        self.traffic.deletes += -(-len(keys) // batch)
        self.store.delete_many(keys)


class Backoff:
    """Waits that grow (×1.5 up to `cap`), so waiting costs O(log) requests, not a tight loop."""

    def __init__(self, first: float, cap: float = 1.0):
        self.delay, self.cap = first, cap

    def sleep(self, deadline: float, wake: threading.Event | None = None) -> bool:
        """Sleep the next interval; False if the deadline has passed (or `wake` is set)."""
        now = time.monotonic()
        if now >= deadline or (wake is not None and wake.is_set()):
            return False
        if wake is None:
            time.sleep(min(self.delay, deadline - now))
        elif wake.wait(min(self.delay, deadline - now)):
            return False
        self.delay = min(self.delay * 1.5, self.cap)
        return True


def reducer_of(shard: int, members: list[int], parts: int = 1, roster: list[int] | None = None) -> int:
    """Who reduces shard j of a round of N·`parts` shards: its owner (the rank at position
    j // parts of the round's `roster`; ranks 0 … N−1 if none is given) if a member, else a member
    chosen by j, so a dead owner's parts are spread over the members."""
    owner = shard // parts if roster is None else roster[shard // parts]
    return owner if owner in members else members[shard % len(members)]


@dataclass(frozen=True)
class RunKeys:
    """The store layout of one run (documented in packages/replica/README.md)."""

    run: str

    def round(self, r: int) -> str:
        return f"{self.run}/r{r:08d}"

    def scatter(self, r: int, shard: int, src: int, lane: int) -> str:
        """Lane `lane` of replica `src`: its piece of shard j (`layout.Cut.pieces`)."""
        return f"{self.round(r)}/scatter/{shard}/{src}.{lane}"

    def ready(self, r: int, src: int | None = None, lanes: int = 1, attempt: int = 0) -> str:
        """Attempt `attempt` of replica `src` of `lanes` processes has every piece it sends in the
        store (the name carries its lane count and attempt, so whoever decides the round learns
        them from one LIST, and everyone can tell when a member's attempt ended: `gather`)."""
        return f"{self.round(r)}/ready/" + ("" if src is None else f"{src}.{lanes}.{attempt}")

    def members(self, r: int) -> str:
        return f"{self.round(r)}/members.json"

    def reduced(self, r: int, owner: int | None = None) -> str:
        """Reduced shard j under a prefix of its own (`reduced/<j>/mean`): every replica GETs every
        reduced shard, N² GETs a round, which in one prefix would pass S3's 5,500 GET/s per prefix
        from N ≈ 64 on (bench/scale.py); one LIST of `reduced/` still finds them all."""
        return f"{self.round(r)}/reduced/" + ("" if owner is None else f"{owner}/mean")

    def repair(self, r: int, owner: int | None = None) -> str:
        return f"{self.round(r)}/repair/" + ("" if owner is None else str(owner))

    def repaired(self, r: int, owner: int) -> str:
        return f"{self.round(r)}/repaired/{owner}"

    def claim(self, r: int, owner: int, generation: int) -> str:
        return f"{self.round(r)}/claim/{owner}.{generation}"

    def checkpoint(self, r: int, piece: tuple[int, int] | str | None = None) -> str:
        """Checkpoint r's piece [a, b) of the model (`<a>-<b>`), or its `void` marker."""
        name = "" if piece is None else piece if isinstance(piece, str) else f"{piece[0]}-{piece[1]}"
        return f"{self.run}/ckpt/r{r:08d}/{name}"

    def checkpoints(self) -> str:
        return f"{self.run}/ckpt/"

    def roster(self) -> str:
        """The launcher's scale requests and away markers, and replicas' join markers (`roster`,
        `diloco.presence`)."""
        return f"{self.run}/roster/"

    def scale(self, seq: int) -> str:
        return f"{self.roster()}scale-{seq:08d}.json"

    def join(self, rank: int, round_: int, attempt: int) -> str:
        """Attempt `attempt` of `rank` takes part from round `round_` on (`diloco.presence`)."""
        return f"{self.roster()}{join_name(rank, round_, attempt)}"

    def low_water(self, r: int | None = None) -> str:
        return f"{self.run}/history/" + ("" if r is None else f"gc-through-r{r:08d}")
