"""The throttled store the sync-mode benchmark runs on: it paces bytes, and is off unless asked for."""

from __future__ import annotations

import threading
import time

import pytest

from diloco.errors import UserError
from diloco.store.objectstore import open_store
from diloco.store.throttle import ThrottledStore, throttled_from_env


def test_off_unless_the_environment_asks():
    store = open_store("memory://throttle-off")
    assert throttled_from_env(store, {}) is store


def test_bad_rate_is_a_one_line_user_error():
    with pytest.raises(UserError, match="DILOCO_STORE_BYTES_PER_S"):
        throttled_from_env(open_store("memory://t"), {"DILOCO_STORE_BYTES_PER_S": "fast"})
    with pytest.raises(UserError, match="must be > 0"):
        throttled_from_env(open_store("memory://t"), {"DILOCO_STORE_BYTES_PER_S": "0"})


def test_uploads_share_the_up_link_and_downloads_have_their_own():
    store = throttled_from_env(open_store("memory://throttle-link"), {"DILOCO_STORE_BYTES_PER_S": "1e6"})
    assert isinstance(store, ThrottledStore)
    t0 = time.monotonic()
    threads = [threading.Thread(target=store.put, args=(f"k{i}", b"x" * 100_000)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.monotonic() - t0 >= 0.3  # 300 kB queued on one 1 MB/s link, not three in parallel
    t0 = time.monotonic()
    assert bytes(store.get("k0")) == b"x" * 100_000  # the data is the data
    assert time.monotonic() - t0 >= 0.1
    assert store.get("missing") is None


def test_every_request_pays_the_latency():
    store = throttled_from_env(open_store("memory://throttle-latency"), {"DILOCO_STORE_LATENCY_S": "0.05"})
    t0 = time.monotonic()
    store.put("a", b"1")
    list(store.list(""))
    store.delete("a")
    assert time.monotonic() - t0 >= 0.15
