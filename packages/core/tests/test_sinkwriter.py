"""Metric sinks beside the supervisor's loop (`diloco.runrecord.sinkwriter`): a slow sink never
holds the caller, every round reaches every sink in order, and a failing sink is reported once
and dropped."""

from __future__ import annotations

import threading
import time

import pytest

from diloco.plugins import sinks as sinks_module
from diloco.runrecord.sinkwriter import SinkWriter
from diloco.runrecord.state import RunRecord


class Recording:
    sink_name = "recording"

    def __init__(self, gate: threading.Event | None = None, fail_at: int | None = None):
        self.gate, self.fail_at = gate, fail_at
        self.written: list[int] = []
        self.closed = False

    def write(self, summary):
        if self.gate is not None:
            assert self.gate.wait(30), "the test never opened the gate"
        if summary == self.fail_at:
            raise ConnectionError("tracking server refused the point")
        self.written.append(summary)

    def close(self):
        self.closed = True


@pytest.fixture
def record():
    return RunRecord.create("sinks", {})


def with_sinks(monkeypatch, *sinks):
    monkeypatch.setattr(sinks_module, "open_sinks", lambda metrics, run_id, run_dir: list(sinks))


def test_a_slow_sink_never_holds_the_caller_and_gets_every_round_in_order(record, monkeypatch):
    gate = threading.Event()
    slow, fast = Recording(gate), Recording()
    with_sinks(monkeypatch, slow, fast)
    writer = SinkWriter(record, "sinks")
    t0 = time.monotonic()
    writer.write([1, 2])
    writer.write([])
    writer.write([3])
    assert time.monotonic() - t0 < 5.0 and slow.written == []  # queued; the sink is still on round 1
    gate.set()
    writer.close()
    assert slow.written == fast.written == [1, 2, 3] and slow.closed and fast.closed
    assert not [e for e in record.events() if e["event"] == "sink_failed"]


def test_a_failing_sink_is_reported_once_and_dropped_the_others_go_on(record, monkeypatch):
    broken, fine = Recording(fail_at=2), Recording()
    with_sinks(monkeypatch, broken, fine)
    writer = SinkWriter(record, "sinks")
    writer.write([1, 2])
    writer.write([3])
    writer.close()
    assert broken.written == [1] and fine.written == [1, 2, 3]
    (failed,) = [e for e in record.events() if e["event"] == "sink_failed"]
    assert failed["sink"] == "recording" and "tracking server refused" in failed["error"]


def test_sinks_that_cannot_open_are_reported_and_the_rounds_go_on(record, monkeypatch):
    def refuse(metrics, run_id, run_dir):
        raise RuntimeError("no such sink")

    monkeypatch.setattr(sinks_module, "open_sinks", refuse)
    writer = SinkWriter(record, "sinks")
    writer.write([1])
    writer.write([2])
    writer.close()
    (failed,) = [e for e in record.events() if e["event"] == "sink_failed"]
    assert failed["sink"] == "*" and "no such sink" in failed["error"]
