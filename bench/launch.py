"""Launch overhead of the local backend, against bare interpreter starts in the same run.

For N = 1, 4, 16 replicas of a no-op entrypoint:
  to_running_s:  submit(plan) called → every replica has entered its entrypoint
                 (the runner's "started" marker, written just before the call);
  to_done_s:     submit(plan) called → every replica's result is on disk;
  bare_parallel_s: N bare `python -c pass` started together and all exited;
  overhead_s:    to_done_s − bare_parallel_s: what diloco adds beyond starting interpreters.
Prints one JSON object. Target: overhead ≤ 0.3 s.

`first_step`: a replica's start to its first optimizer step (torch and the replica runtime
imported), forked from a warm template against a fresh interpreter (`first_step_rows`).
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

from diloco.local.executor import LocalProcessExecutor
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
                      "cpus": os.cpu_count(), "results": rows, "target_overhead_s": 0.3,
                      "first_step": first_step_rows()}, indent=2))


def first_step_rows() -> list[dict]:
    """A replica's start as DiLoCo replicas have it (the runtime imported, one optimizer step:
    `_launch_job.first_step`), forked from a warm template (`diloco.local.warmstart`, the default) and
    from a fresh interpreter, alternating in each repeat of the same run. The warm executor's
    template is up before the first timed launch, as it is for every relaunch and every launch
    after a run's first: its own start is `template_s`. Host memory: the replicas' peak RSS and
    their PSS (which counts the pages a fork shares once)."""
    bench = str(Path(__file__).parent)
    rows = []
    with tempfile.TemporaryDirectory() as state:
        executors = {warm: LocalProcessExecutor(state_dir=state, warm_start=warm) for warm in (True, False)}
        t0 = time.perf_counter()
        executors[True].collect(launch(executors[True], 1, "_launch_job:first_step", {}, run_id="warmup",
                                       workdir=bench, timeout=300), timeout=300)
        template_s = time.perf_counter() - t0
        for n in [int(x) for x in knob("BENCH_REPLICAS", "1,4,16", "1,4").split(",")]:
            times: dict[bool, list[float]] = {True: [], False: []}
            memory: dict[bool, list[dict]] = {True: [], False: []}
            for i in range(REPEATS):
                for warm in (True, False):
                    t0_wall = time.time()
                    handles = launch(executors[warm], n, "_launch_job:first_step", {}, workdir=bench, timeout=300,
                                     run_id=f"step-{'warm' if warm else 'fresh'}-{n}-{i}")
                    results = executors[warm].collect(handles, timeout=300)
                    assert all(r.status.value == "succeeded" for r in results), [r.error for r in results]
                    assert all(h.metadata["forked"] is warm for h in handles)
                    times[warm].append(max(r.result["stepped_at"] for r in results) - t0_wall)
                    memory[warm] += [r.result for r in results]
            med = statistics.median
            for warm in (True, False):
                rows.append({"n": n, "start": "warm" if warm else "fresh",
                             "to_first_step_s": round(med(times[warm]), 3),
                             "replica_peak_rss_mb": round(max(m["rss_mb"] for m in memory[warm]), 1),
                             "replica_pss_mb": round(med(m["pss_mb"] for m in memory[warm]), 1),
                             "template_s": round(template_s, 3) if warm else None})
            rows[-2]["speedup_vs_fresh"] = round(rows[-1]["to_first_step_s"] / rows[-2]["to_first_step_s"], 1)
        for ex in executors.values():
            ex.close()
    return rows


if __name__ == "__main__":
    main()
