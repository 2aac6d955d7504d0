"""Store requests made to show a run's progress, against the number of rounds (prints JSON).

A run of R rounds × N replicas is written to a file:// store (rows and round summaries, as the
replicas write them). Then, counting every GET and LIST:

- `diloco status` on a finished run, first call (empty cache) and every later call (cached);
- the progress display of `diloco run` (the supervisor's tick) when 1 new round appeared;
- the baseline: reading every metrics row ever written, which is what status and the
  end-of-run report did before round summaries (R·N GETs per call).

Target: status and the display read O(new rounds) objects; a finished run's status is flat in R.
    .venv/bin/python bench/status_reads.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from diloco.store.metrics import RoundMetrics, RoundReader, RoundSummary, read_rounds
from diloco.store.runkeys import RunKeys
from diloco.store.objectstore import open_store
from diloco.testing.counting import RequestCounter

N = 8


def write_run(store, run: str, rounds: range) -> None:
    for r in rounds:
        rows = [RoundMetrics(round=r, rank=k, members=list(range(N)), loss=1.0, tokens=1000, compute_s=1.0,
                             sync_s=0.05, state_digest="00000000-00000000") for k in range(N)]
        for row in rows:
            store.put(RunKeys(run).metrics(r, row.rank), row.to_json())
        store.put(RunKeys(run).summary(r), RoundSummary.from_rows(r, rows).to_json())


def every_row(store, run: str) -> int:
    """The old way: GET every metrics object ever written."""
    n = 0
    for meta in store.list(f"{run}/metrics/"):
        store.get(meta["path"])
        n += 1
    return n


def main(sizes=(10, 100, 1000)) -> None:
    results = []
    for R in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            store = RequestCounter(open_store(Path(tmp, "store").as_uri()))
            run = f"bench-{R}"
            write_run(store.store, run, range(1, R + 1))
            cache = Path(tmp, "records")
            read_rounds(None, run, store=store, cache_dir=cache, final=True)
            status_first = store.take()
            read_rounds(None, run, store=store, cache_dir=cache, final=True)
            status_cached = store.take()
            display = RoundReader(store, run, after=R)
            write_run(store.store, run, range(R + 1, R + 2))
            display.read_new()
            tick_one_new = store.take()
            display.read_new()
            tick_idle = store.take()
            every_row(store, run)
            baseline = store.take()
            results.append({"rounds": R, "replicas": N, "status_first_call": status_first,
                            "status_later_calls": status_cached, "display_tick_1_new_round": tick_one_new,
                            "display_tick_idle": tick_idle, "baseline_every_row": baseline,
                            "status_later_vs_baseline_gets": f"{status_cached['gets']}/{baseline['gets']}"})
    json.dump({"benchmark": "status_reads", "results": results}, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    from _common import QUICK

    main((10,) if QUICK else (10, 100, 1000))
