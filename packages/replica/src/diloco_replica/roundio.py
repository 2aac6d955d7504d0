"""The round's I/O: one object every part of a round reaches the store through.

Membership, reduce, gather, repairs, history, the recorder and the global state all read and
write the same store, under the same keys, counting the same traffic, with the same timeouts and
polling and the same fault-injection hooks. `RoundIO` is that one object, made once per replica
(per lane) by `StoreAllReduce` and handed to each part, so none of them reaches into another
for it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from diloco.store import ObjectExists

from .faults import Faults
from .storeaccess import Backoff, CountingStore, LaneShards, RunKeys
from .wire import CorruptObject, Identity, unpack

if TYPE_CHECKING:  # lanes imports membership, which takes a RoundIO
    from .lanes import Lanes


@dataclass
class RoundIO:
    store: CountingStore
    keys: RunKeys
    shards: LaneShards
    lanes: "Lanes"
    pool: ThreadPoolExecutor
    run_id: str
    rank: int
    n: int                         # replicas in the run (world size)
    round_timeout: float
    poll_interval: float
    poll_max: float
    log: Callable[[str], None] = lambda msg: None
    faults: Faults = field(default_factory=Faults)

    def sid(self, j: int) -> int:
        """Shard j of this lane, as the store names it."""
        return self.shards.sid(j)

    def backoff(self) -> Backoff:
        return Backoff(self.poll_interval, self.poll_max)

    def put(self, key: str, data, *, create_only: bool = False, written: tuple | None = None) -> bool:
        """Write `key`; False if `create_only` and it exists. `written` = (kind, round, shard[, writer])
        names the object for the fault-injection hook, which may damage it at rest afterwards."""
        try:
            self.store.put(key, data, create_only=create_only)
        except ObjectExists:
            return False
        if written is not None:
            self.faults.after_write(self.store.store, key, *written)
        return True

    def present(self, prefix: str) -> set[int]:
        """This lane's shard indices among the objects under `prefix` (one LIST)."""
        return self.shards.mine(self.store.list_names(prefix))

    def get_verified(self, key: str, ident: Identity):
        """(unpacked, None), (None, "missing") or (None, reason): a corrupt read is retried once,
        since a torn transfer heals on a second read and damage at rest does not."""
        for _ in range(2):
            blob = self.store.get(key)
            if blob is None:
                return None, "missing"
            try:
                return unpack(blob, ident, key), None
            except CorruptObject as exc:
                reason = str(exc)
        return None, reason
