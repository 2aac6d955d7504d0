"""The round's I/O: one object every part of a round reaches the store through.

Membership, reduce, gather, repairs, checkpoints, the recorder and the global state all read and
write the same store, under the same keys, counting the same traffic, with the same timeouts and
polling and the same fault-injection hooks. `RoundIO` is that one object, made once per replica
(per lane) by `StoreAllReduce` and handed to each part, so none of them reaches into another
for it, and none copies its store, keys or settings into fields of its own. Every object of
the protocol is read and checked one way (`get_verified`; `get_scatter` and `get_reduced` name
a contribution and a reduced shard by round and shard). What still reaches past its methods:
the recorder writes metrics rows and round summaries under keys of its own (`diloco.store.metrics`),
the summary straight to the store beneath (uncounted); garbage collection lists the run's round
directories there (uncounted, its deletes counted); checkpoint loading reads shards without
`get_verified`'s retry (a corrupt shard voids the checkpoint).

It also holds the incidents met outside a round — a corrupt checkpoint or reduced shard found
while rejoining or catching up (`report`) — until the replica's next metrics row carries them
(`take_found`), so they reach the round summary and the launcher's `incident` events too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from diloco.store.runkeys import RunKeys
from diloco.store.objectstore import ObjectExists

from ..transport.faults import Faults
from .lanes import Lanes
from .polling import Poll
from .storeaccess import CountingStore
from ..transport.wire import CorruptObject, Identity, Unpacked, unpack


@dataclass
class RoundIO:
    store: CountingStore
    keys: RunKeys
    lanes: Lanes
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

    def clock(self) -> float:
        """Seconds for the rounds' deadlines: time.monotonic(), except that it stands still while
        the store is away (`diloco.store.outage`), so an outage is waited for, not timed out."""
        outage = getattr(self.store.store, "outage", None)  # a store handed in (a bench's, a user's) may not wait
        return outage.clock() if outage is not None else time.monotonic()

    def poll(self, what: str, *, timeout: float | None = None, **how) -> Poll:
        """A wait for `what` at the run's pace (`poll_interval` growing to `poll_max`), on the round's
        clock, ending after `timeout` (default: `round_timeout`); `how`: `Poll`'s other settings."""
        return Poll(what, first=self.poll_interval, cap=self.poll_max, clock=self.clock,
                    timeout=self.round_timeout if timeout is None else timeout, **how)

    def put(self, key: str, data, *, create_only: bool = False, written: tuple | None = None) -> bool:
        """Write `key`; False if `create_only` and it exists. `written` = (kind, round, shard[, writer])
        names the object for the fault-injection hook, which may damage it on its way in."""
        if written is not None:
            data = self.faults.as_written(data, *written)
        try:
            self.store.put(key, data, create_only=create_only)
        except ObjectExists:
            return False
        return True

    def present(self, prefix: str) -> set[int]:
        """The shard indices among the objects under `prefix` (`<shard>` or `<shard>/...`; one LIST)."""
        firsts = (x.split("/", 1)[0] for x in self.store.list_names(prefix))
        return {int(x) for x in firsts if x.isdigit()}

    def exists(self, key: str) -> bool:
        """Whether `key` is in the store (one GET: the store interface has no HEAD)."""
        return self.store.get(key) is not None

    def get_verified(self, key: str, ident: Identity, *, numel: int | None = None,
                     codec: str | None = None) -> tuple[Unpacked | None, str | None]:
        """The one way an object is read and checked: (unpacked, None), (None, "missing") or
        (None, reason). A corrupt read is retried once, since a torn transfer heals on a second
        read and damage at rest does not. `ident`: who the object must claim to be; `numel` and
        `codec`: the layout it must have (`wire.check_layout`)."""
        for _ in range(2):
            blob = self.store.get(key)
            if blob is None:
                return None, "missing"
            try:
                return unpack(blob, ident, key, numel=numel, codec=codec), None
            except CorruptObject as exc:
                reason = str(exc)
        return None, reason

    def get_scatter(self, r: int, j: int, writer: int, lane: int, numel: int) -> tuple[Unpacked | None, str | None]:
        """Lane `lane` of replica `writer`: its piece of shard j in round r, verified (`get_verified`)
        in the run's codec; the piece's lane is in its identity (`scatter_identity`)."""
        return self.get_verified(self.keys.scatter(r, j, writer, lane), self.scatter_identity(r, j, writer, lane),
                                 numel=numel, codec=self.codec)

    def scatter_identity(self, r: int, j: int, writer: int, lane: int) -> Identity:
        """Who a piece claims to be: shard j from replica `writer`'s lane `lane`."""
        return Identity(self.run_id, r, "scatter", j, writer, lane)

    def reduced_identity(self, r: int, j: int) -> Identity:
        """Who shard j's mean of round r claims to be, as published and as re-published."""
        return Identity(self.run_id, r, "reduced", j, -1)

    def get_reduced(self, r: int, j: int, numel: int, *, repaired: bool = False) -> tuple[Unpacked | None, str | None]:
        """Shard j's mean of round r (`repaired`: its reducer's re-publication), verified (`get_verified`)."""
        key = self.keys.repaired(r, j) if repaired else self.keys.reduced(r, j)
        return self.get_verified(key, self.reduced_identity(r, j), numel=numel, codec=self.codec)

    def report(self, incident: dict[str, Any]) -> None:
        """An incident met outside a round (rejoin, catch-up): kept for the next metrics row."""
        self.found.append(incident)
        self.log(f"incident: {incident.get('object')}: {incident.get('problem')}; {incident.get('action')}")

    def take_found(self) -> list[dict[str, Any]]:
        """The incidents reported since the last call (each is handed out once)."""
        found, self.found = self.found, []
        return found
