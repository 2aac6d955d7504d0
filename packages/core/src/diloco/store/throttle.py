"""A store behind a slow link: the benchmark's (and tests') stand-in for a replica's real bandwidth.

Never on by default. A replica's store goes through it only when `DILOCO_STORE_BYTES_PER_S` is
set (put it in the spec's [env]); `DILOCO_STORE_LATENCY_S` adds a fixed wait to every request,
like a round trip to a remote region.

    [env]
    DILOCO_STORE_BYTES_PER_S = "2e6"     # 2 MB/s up and 2 MB/s down, per replica process
    DILOCO_STORE_LATENCY_S = "0.02"

The link is full duplex, like a NIC: uploads share one byte budget, downloads another, and
concurrent transfers in the same direction queue behind each other (a transfer of n bytes
occupies the link for n / rate seconds), so eight parallel uploads take as long as one of eight
times the size. Waiting happens in the calling thread, so it overlaps compute exactly as a slow
network transfer would.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..errors import UserError
from .objectstore import Store

ENV_RATE = "DILOCO_STORE_BYTES_PER_S"
ENV_LATENCY = "DILOCO_STORE_LATENCY_S"


@dataclass
class Link:
    """One direction of a link: transfers queue for it, each for bytes / rate seconds."""

    rate: float
    _free_at: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def transfer(self, nbytes: int) -> None:
        with self._lock:
            start = max(time.monotonic(), self._free_at)
            self._free_at = start + nbytes / self.rate
            done = self._free_at
        wait = done - time.monotonic()
        if wait > 0:
            time.sleep(wait)


class ThrottledStore(Store):
    """`Store` with every object's bytes paced through an up link and a down link."""

    def __init__(self, store: Store, bytes_per_s: float, latency_s: float = 0.0):
        super().__init__(store.raw, store.uri, store.outage)
        self.up, self.down = Link(bytes_per_s), Link(bytes_per_s)
        self.latency_s = latency_s

    def _round_trip(self) -> None:
        if self.latency_s:
            time.sleep(self.latency_s)

    def put(self, key: str, data: bytes | memoryview | list[bytes | memoryview], *, create_only: bool = False) -> None:
        parts = data if isinstance(data, list) else [data]
        self._round_trip()
        self.up.transfer(sum(memoryview(x).nbytes for x in parts))
        super().put(key, data, create_only=create_only)

    def get(self, key: str) -> memoryview | None:
        self._round_trip()
        data = super().get(key)
        if data is not None:
            self.down.transfer(data.nbytes)
        return data

    def list(self, prefix: str, *, offset: str | None = None) -> Iterator[dict[str, Any]]:
        self._round_trip()
        yield from super().list(prefix, offset=offset)

    def list_dirs(self, prefix: str) -> list[str]:
        self._round_trip()
        return super().list_dirs(prefix)

    def delete(self, key: str) -> None:
        self._round_trip()
        super().delete(key)

    def delete_many(self, keys: list[str]) -> None:
        for _ in range(-(-len(keys) // self.bulk_delete)):
            self._round_trip()
        super().delete_many(keys)


def throttled_from_env(store: Store, env: dict[str, str] | None = None) -> Store:
    """`store` behind the link the environment asks for, or `store` itself when it asks for none."""
    env = os.environ if env is None else env
    raw_rate, raw_latency = env.get(ENV_RATE, ""), env.get(ENV_LATENCY, "")
    if not raw_rate and not raw_latency:
        return store
    try:
        rate = float(raw_rate) if raw_rate else float("inf")
        latency = float(raw_latency) if raw_latency else 0.0
    except ValueError:
        raise UserError(f"{ENV_RATE}={raw_rate!r} / {ENV_LATENCY}={raw_latency!r}: both must be numbers "
                        f"(bytes per second, seconds)") from None
    if rate <= 0 or latency < 0:
        raise UserError(f"{ENV_RATE} must be > 0 and {ENV_LATENCY} >= 0; got {raw_rate!r}, {raw_latency!r}")
    return ThrottledStore(store, rate, latency)
