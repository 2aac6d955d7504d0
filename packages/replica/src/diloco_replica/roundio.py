"""The round's I/O: one object every part of a round reaches the store through.

Membership, reduce, gather, repairs, checkpoints, the recorder and the global state all read and
write the same store, under the same keys, counting the same traffic, with the same timeouts and
polling and the same fault-injection hooks. `RoundIO` is that one object, made once per replica
(per lane) by `StoreAllReduce` and handed to each part, so none of them reaches into another
for it. Not all of them keep to its methods yet: `Membership` and `Checkpoints` copy its store,
keys and settings into their own fields, and the repairs ask its store directly whether a reduced
shard exists.

It also holds the incidents met outside a round — a corrupt checkpoint or reduced shard found
while rejoining or catching up (`report`) — until the replica's next metrics row carries them
(`take_found`), so they reach the round summary and the launcher's `incident` events too.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

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
    codec: str = "fp32"            # the run's transport codec: every scatter and reduced object is in it
    found: list[dict[str, Any]] = field(default_factory=list)  # incidents met outside a round, not yet reported

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

    def get_verified(self, key: str, ident: Identity, *, numel: int | None = None, codec: str | None = None):
        """(unpacked, None), (None, "missing") or (None, reason): a corrupt read is retried once,
        since a torn transfer heals on a second read and damage at rest does not. `numel` and
        `codec`: the layout the object must have (`wire.check_layout`)."""
        for _ in range(2):
            blob = self.store.get(key)
            if blob is None:
                return None, "missing"
            try:
                return unpack(blob, ident, key, numel=numel, codec=codec), None
            except CorruptObject as exc:
                reason = str(exc)
        return None, reason

    def report(self, incident: dict[str, Any]) -> None:
        """An incident met outside a round (rejoin, catch-up): kept for the next metrics row."""
        self.found.append(incident)
        self.log(f"incident: {incident.get('object')}: {incident.get('problem')}; {incident.get('action')}")

    def take_found(self) -> list[dict[str, Any]]:
        """The incidents reported since the last call (each is handed out once)."""
        found, self.found = self.found, []
        return found
