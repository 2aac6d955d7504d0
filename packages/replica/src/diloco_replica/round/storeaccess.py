"""The store as the round protocol uses it: counted requests, and who reduces a shard (waiting
on it is `polling`'s).

Everything above this module addresses objects through `diloco.store.runkeys.RunKeys` (the layout,
written down once for the launcher and the replicas alike) and moves them through
`CountingStore`, so bytes and requests per round are measured in one place.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

from diloco.store.objectstore import Store

from diloco.store.wiresize import Traffic


class CountingStore:
    """Wraps the run's store; counts every byte and request made through it.

    Requests made inside `polling()` are also counted as polls: re-checks while waiting for
    other replicas, whose number depends on how long the wait was, not on the protocol (the
    estimate in `diloco.spec.estimate` predicts the rest exactly).
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


def owner_of(shard: int, roster: list[int]) -> int:
    """The replica that owns part j of a round of N·P parts: the rank at position j mod N of the
    round's `roster`. Interleaved, not in runs of P: a replica's parts lie all along the vector,
    so every lane of a replica of L processes (of K nodes) reduces its share of them and the
    round's bytes spread over all its lanes' links, not over the few lanes a contiguous N-th of
    the vector falls in (bench/nodes.py)."""
    return roster[shard % len(roster)]


def reducer_of(shard: int, members: list[int], roster: list[int] | None = None) -> int:
    """Who reduces part j of a round: its owner (`owner_of`; with no `roster`, the members are
    it) if a member, else a member chosen by the owner's place and the part's place among its
    owner's, so a dead owner's parts (and two dead owners' first parts) spread over the members."""
    roster = members if roster is None else roster
    owner = owner_of(shard, roster)
    n = len(roster)
    return owner if owner in members else members[(shard // n + shard % n) % len(members)]
