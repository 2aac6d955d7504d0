"""A store outage against the real client: moto's S3 API behind a proxy that goes down
(connections refused, then 503 Service Unavailable), talked to by obstore through `diloco.store.objectstore`.
The whole run through an outage is tests/test_store_outage.py's; here, one process's requests."""

from __future__ import annotations

import os
import time

import pytest

from diloco.store.objectstore import open_store
from diloco.store.outage import StoreUnreachable
from diloco.testing.s3proxy import FaultyS3Proxy
from diloco.testing.s3server import moto_s3


@pytest.fixture
def proxied(monkeypatch):
    with moto_s3() as server:
        for k, v in server["env"].items():
            monkeypatch.setenv(k, v)
        with FaultyS3Proxy(server["env"]["AWS_ENDPOINT_URL"]) as proxy:
            monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
            yield server, proxy


def test_requests_wait_out_an_outage_and_the_round_clock_stands_still(proxied):
    server, proxy = proxied
    said: list[str] = []
    store = open_store(server["uri"], outage_limit=60, log=said.append)
    store.put("run/a", b"before")
    before = store.outage.clock()
    t0 = time.monotonic()
    proxy.go_down(refuse_s=3, unavailable_s=3)
    time.sleep(0.2)
    store.put("run/b", b"during", create_only=True)  # waits for the store, then writes once
    assert proxy.outage_done.is_set() and time.monotonic() - t0 >= 6
    assert proxy.unavailable > 0
    assert bytes(store.get("run/b")) == b"during"
    assert sorted(m["path"] for m in store.list("run/")) == ["run/a", "run/b"]
    away = store.outage.away_s
    assert 4 <= away <= time.monotonic() - t0 and store.outage.clock() - before < time.monotonic() - t0 - away + 1
    assert any("not serving requests" in s for s in said) and any("serves requests again" in s for s in said)


def test_past_the_limit_a_request_fails_with_one_line_naming_the_store(proxied):
    server, proxy = proxied
    store = open_store(server["uri"], outage_limit=4)
    proxy.go_down(refuse_s=30, unavailable_s=0)
    time.sleep(0.2)
    t0 = time.monotonic()
    with pytest.raises(StoreUnreachable) as err:
        store.get("run/a")
    assert 4 <= time.monotonic() - t0 < 20
    msg = str(err.value)
    assert "\n" not in msg and server["uri"] in msg and "store_outage_limit = 4 s" in msg, msg


def test_a_store_that_answers_no_is_not_waited_for(proxied, monkeypatch):
    server, _ = proxied
    store = open_store(server["uri"].replace("diloco-test", "no-such-bucket"), outage_limit=60)
    t0 = time.monotonic()
    with pytest.raises(FileNotFoundError):  # NoSuchBucket: an answer, raised at once
        store.put("run/a", b"x")
    assert time.monotonic() - t0 < 5 and store.outage.since is None
    assert os.environ["AWS_ENDPOINT_URL"].startswith("http://127.0.0.1:")
