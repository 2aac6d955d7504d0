"""Launch overhead of the local backend, against bare interpreter starts in the same run.

For N = 1, 4, 16 replicas of a no-op entrypoint:
  to_running_s:  submit(plan) called → every replica has entered its entrypoint
                 (the runner's "started" marker, written just before the call);
  to_done_s:     submit(plan) called → every replica's result is on disk;
  bare_parallel_s: N bare `python -c pass` started together and all exited;
  overhead_s:    to_done_s − bare_parallel_s: what diloco adds beyond starting interpreters.
Prints one JSON object. Target: overhead ≤ 0.3 s.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from diloco.local import LocalProcessExecutor
from diloco.testing import launch

from _common import knob  # noqa: E402 - bench/ is the script's directory

REPEATS = int(knob("BENCH_REPEATS", "3", "1"))


def bare_parallel(n: int) -> float:
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", "pass"]) for _ in range(n)]
    for p in procs:
        p.wait()
    return time.perf_counter() - t0


def launch_once(ex: LocalProcessExecutor, n: int, run_id: str) -> tuple[float, float]:
    t0_wall = time.time()
    t0 = time.perf_counter()
    handles = launch(ex, n, "diloco.testing.entrypoints:noop", {}, run_id=run_id, timeout=120)
    started = [Path(h.metadata["stem"] + ".started.json") for h in handles]
    results = [Path(h.metadata["stem"] + ".result.json") for h in handles]
    while not all(p.exists() for p in results):
        time.sleep(0.002)
    done = time.perf_counter() - t0
    to_running = max(json.loads(p.read_text())["started_at"] for p in started) - t0_wall
    ex.collect(handles, timeout=60)  # reap
    return to_running, done


def main() -> None:
    # An installed package has .pyc files (pip byte-compiles); an editable checkout under
    # PYTHONDONTWRITEBYTECODE=1 would recompile diloco in every replica and measure that instead.
    import compileall

    import diloco

    compileall.compile_dir(str(Path(diloco.__file__).parent), quiet=1)
    with tempfile.TemporaryDirectory() as state:
        ex = LocalProcessExecutor(state_dir=state)
        launch_once(ex, 1, "warmup")
        bare_parallel(1)
        rows = []
        for n in [int(x) for x in knob("BENCH_REPLICAS", "1,4,16", "1,4").split(",")]:
            running, done, bare = [], [], []
            for i in range(REPEATS):
                bare.append(bare_parallel(n))
                r, d = launch_once(ex, n, f"bench-{n}-{i}")
                running.append(r)
                done.append(d)
            med = statistics.median
            rows.append({"n": n, "to_running_s": round(med(running), 4), "to_done_s": round(med(done), 4),
                         "bare_parallel_s": round(med(bare), 4),
                         "overhead_s": round(med(done) - med(bare), 4),
                         "ratio_vs_bare": round(med(done) / med(bare), 2)})
    print(json.dumps({"bench": "launch", "backend": "local", "repeats": REPEATS,
                      "bare_interpreter_s": round(statistics.median(bare_parallel(1) for _ in range(5)), 4),
                      "cpus": os.cpu_count(), "results": rows, "target_overhead_s": 0.3}, indent=2))


if __name__ == "__main__":
    main()
