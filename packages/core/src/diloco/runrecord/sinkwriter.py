"""The spec's metric sinks, written beside the supervisor's loop.

A sink's work is slow next to a look at the replicas: opening the TensorBoard sink imports
tensorboardX (1.0-1.2 s of a core here, more under the replicas' load), a tracking server may
take its time to answer. Done on the supervisor's loop, it held every rank's poll and relaunch
for as long. So each batch of new round summaries is handed to one worker thread, which opens
the sinks at the first batch and writes every batch to each of them in order; a sink that fails
is reported once (`sink_failed`) and dropped, as before. `close` writes what is queued, then
closes the sinks.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

from ..bootstrap.failures import shorten
from .state import RunRecord

CLOSE_TIMEOUT_S = 60.0  # what a sink may take to write the last rounds and close, at the run's end


class SinkWriter:
    """Writes round summaries to the run's sinks (the spec's `[metrics]`) on a thread of its own."""

    def __init__(self, record: RunRecord, run_id: str):
        self.record, self.run_id = record, run_id
        self._queue: queue.Queue[list[Any] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._sinks: list[Any] | None = None  # opened by the worker at the first batch

    def write(self, summaries: list[Any]) -> None:
        """Queue new rounds for every sink; returns at once."""
        if not summaries:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="diloco-sinks", daemon=True)
            self._thread.start()
        self._queue.put(list(summaries))

    def close(self) -> None:
        """Write what is queued, then close the sinks (a sink still busy after CLOSE_TIMEOUT_S is
        left to the process's end, and said so)."""
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join(CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            self.record.event("sink_failed", sink="*", error=f"still writing after {CLOSE_TIMEOUT_S:.0f}s at the "
                                                             f"run's end; its last rounds may be missing")
        self._thread = None

    def _work(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is None:
                break
            self._write(batch)
        for sink in self._sinks or []:
            try:
                sink.close()
            except Exception:  # noqa: BLE001 - closing is best effort; the points are written
                pass
        self._sinks = None

    def _write(self, summaries: list[Any]) -> None:
        if self._sinks is None:
            from ..plugins.sinks import open_sinks

            metrics = (self.record.data.get("spec") or {}).get("metrics") or {}
            try:
                self._sinks = open_sinks(metrics, self.run_id, self.record.dir)
            except Exception as exc:  # noqa: BLE001 - reported; the run goes on without sinks
                self.record.event("sink_failed", sink="*", error=shorten(str(exc)))
                self._sinks = []
        for sink in list(self._sinks):
            try:
                for summary in summaries:
                    sink.write(summary)
            except Exception as exc:  # noqa: BLE001 - reported once, and the sink dropped
                self.record.event("sink_failed", sink=getattr(sink, "sink_name", "?"), error=shorten(str(exc)))
                self._sinks.remove(sink)
