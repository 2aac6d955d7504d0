"""Scale by simulation: N = 4 … 256 replicas' real round code in one process, against a simulated S3.

Each replica is a `StoreAllReduce` — the replica package's own round code, threads and pools, not
a model of it — running rounds of a small fp32 vector against `SimulatedS3`, an in-memory store
that behaves like S3 as seen from one client:

- every request costs a first-byte latency (20 ms) plus its bytes at one connection's bandwidth
  (100 MB/s; a request is a connection);
- every prefix (the key up to its last "/") takes at most 3,500 PUT/DELETE and 5,500 GET/LIST
  requests a second; past that it answers 503 SlowDown and the client retries with exponential
  backoff, as S3's SDKs do (each 503 is counted).

Time is virtual. The round code's clock (`time` in the replica modules it uses) is a
`VirtualClock` whose `sleep` parks the thread; a scheduler advances the clock to the next wake-up
whenever the process has been idle (no CPU, nothing newly asleep) for a few milliseconds. So CPU
time is free — each replica would have its own machine, and for these shard sizes its CPU work is
small against the latency — and 256 replicas' requests cost what S3 would charge them in time,
not what two cores of Python need to run them all.

Per N, after a warm-up round: round_s (virtual seconds, slowest replica), requests and polls per
replica per round, the peak request rate any one prefix saw in a one-second window (PUT class,
GET class) and the 503s. Target (issue "Lean rounds"): round time at N = 256 within 2× of N = 8,
no prefix above 3,500 requests/s.

    .venv/bin/python bench/scale.py                     # N = 4 … 256 (~15 minutes here)
    BENCH_PNG=docs/scale.png .venv/bin/python bench/scale.py   # and plot it
    BENCH_COMPARE=5bd2dc5 ...   # also that revision's code, in a process of its own per row (N ≤ 128)
    BENCH_QUICK=1 .venv/bin/python bench/scale.py       # N = 4, 8, 16
Prints JSON rows {replicas, round_s, requests_per_replica_per_round, peak_prefix_requests_per_s, ...}.
"""

from __future__ import annotations

import heapq
import itertools
import json
import os
import re
import subprocess
import sys
import threading
import time as real_time
from collections import defaultdict, deque
from contextlib import ExitStack
from typing import Any

from _common import baseline_sources, knob  # noqa: E402 - bench/ is the script's directory

REPLICAS = [int(x) for x in knob("BENCH_REPLICAS", "4,8,16,32,64,128,256", "4,8,16").split(",")]
COMPARE = os.environ.get("BENCH_COMPARE", "")  # a git revision whose code runs each row too (N ≤ BENCH_COMPARE_MAX)
COMPARE_MAX = int(os.environ.get("BENCH_COMPARE_MAX", "128"))
ELEMENTS = int(knob("BENCH_ELEMENTS", "262144", "16384"))  # fp32 elements per replica (1 MB)
LATENCY_S = float(knob("BENCH_LATENCY_S", "0.02", "0.02"))
BANDWIDTH = float(knob("BENCH_BANDWIDTH", "100e6", "100e6"))  # bytes/s of one connection
PUT_RATE, GET_RATE = 3500, 5500
IDLE_S = 0.004  # real seconds of idleness before the clock moves on
REPLICA_MODULES = ("round.allreduce", "round.steps.gather", "round.steps.membership", "round.storeaccess",
                   "round.steps.repairs", "round.io", "round.state",
                   # the same modules in a BENCH_COMPARE revision from before the sub-packages
                   "allreduce", "gather", "membership", "storeaccess", "repairs", "roundio", "roundstate")


def present(module: str) -> bool:
    """Whether this tree has the module (its parent package may be missing too)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


class VirtualClock:
    """`time` for the round code: monotonic/time/perf_counter read the virtual clock; sleep parks."""

    def __init__(self) -> None:
        self.now = 0.0
        self._lock = threading.Lock()
        self._sleepers: list[tuple[float, int, threading.Event]] = []
        self._seq = itertools.count()
        self.changes = 0  # bumped whenever a thread goes to sleep: the process is not idle yet
        self._stop = threading.Event()

    def monotonic(self) -> float:
        return self.now

    time = perf_counter = monotonic

    def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            return
        ev = threading.Event()
        with self._lock:
            heapq.heappush(self._sleepers, (self.now + seconds, next(self._seq), ev))
            self.changes += 1
        ev.wait()

    def run(self) -> None:
        """Advance to the next wake-up whenever nothing runs: no CPU spent, nobody newly asleep."""
        last_cpu, last_changes = real_time.process_time(), -1
        while not self._stop.is_set():
            real_time.sleep(IDLE_S)
            cpu = real_time.process_time()
            idle = cpu - last_cpu < 0.25 * IDLE_S and self.changes == last_changes
            last_cpu, last_changes = cpu, self.changes
            if not idle:
                continue
            with self._lock:
                if not self._sleepers:
                    continue
                wake = self._sleepers[0][0]
                self.now = max(self.now, wake)
                while self._sleepers and self._sleepers[0][0] <= self.now:
                    heapq.heappop(self._sleepers)[2].set()

    def wait_for(self, seconds: float, waiters: set, lock: threading.Lock) -> None:
        """Park until `seconds` of virtual time pass or the event owning `waiters` is set."""
        ev = threading.Event()
        with lock:
            waiters.add(ev)
        with self._lock:
            heapq.heappush(self._sleepers, (self.now + seconds, next(self._seq), ev))
            self.changes += 1
        ev.wait()
        with lock:
            waiters.discard(ev)

    def stop(self) -> None:
        self._stop.set()


def virtual_events(clock: VirtualClock):
    """A `threading` whose Event.wait(timeout) waits in virtual time (the repair watcher's pacing)."""

    class VirtualEvent(threading.Event):
        def __init__(self) -> None:
            super().__init__()
            self._waiters: set = set()
            self._waiters_lock = threading.Lock()

        def set(self) -> None:
            super().set()
            with self._waiters_lock:
                for ev in self._waiters:
                    ev.set()

        def wait(self, timeout: float | None = None) -> bool:
            if timeout is None or self.is_set():
                return super().wait(timeout)
            clock.wait_for(timeout, self._waiters, self._waiters_lock)
            return self.is_set()

    class Namespace:
        Event = VirtualEvent
        Thread, Lock = threading.Thread, threading.Lock

    return Namespace


class SimulatedS3:
    """The `diloco.store.objectstore.Store` interface over a dict, with S3's latency, bandwidth and prefix limits."""

    uri = "s3://simulated/runs"
    raw = None
    bulk_delete = 1000

    def __init__(self, clock: VirtualClock):
        self.clock = clock
        self.objects: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._recent: dict[tuple[str, str], deque] = defaultdict(deque)
        self.peak = {"put": 0, "get": 0}
        self.hottest = {"put": "", "get": ""}
        self.slowdowns = 0

    def reset_peaks(self) -> None:
        with self._lock:
            self.peak, self.hottest, self.slowdowns = {"put": 0, "get": 0}, {"put": "", "get": ""}, 0

    def _request(self, kind: str, key: str, nbytes: int = 0) -> None:
        """Pay for one request: wait out a 503 SlowDown while its prefix is over S3's rate, then
        the latency and the transfer."""
        prefix, limit = key.rsplit("/", 1)[0], PUT_RATE if kind == "put" else GET_RATE
        for attempt in itertools.count():
            with self._lock:
                recent, now = self._recent[(kind, prefix)], self.clock.now
                while recent and recent[0] <= now - 1.0:
                    recent.popleft()
                if len(recent) < limit:
                    recent.append(now)
                    if len(recent) > self.peak[kind]:
                        self.peak[kind] = len(recent)
                        self.hottest[kind] = re.sub(r"\d+", "N", prefix.split("/", 1)[-1])  # which kind of prefix
                    break
                self.slowdowns += 1
            self.clock.sleep(min(0.05 * 2 ** attempt, 5.0))  # the SDKs' backoff before a retry
        self.clock.sleep(LATENCY_S + nbytes / BANDWIDTH)

    def put(self, key: str, data: Any, *, create_only: bool = False) -> None:
        from diloco.store.objectstore import ObjectExists

        parts = data if isinstance(data, list) else [data]
        blob = b"".join(bytes(p) for p in parts)
        self._request("put", key, len(blob))
        with self._lock:
            if create_only and key in self.objects:
                raise ObjectExists(key)
            self.objects[key] = blob

    def get(self, key: str) -> memoryview | None:
        with self._lock:
            blob = self.objects.get(key)
        self._request("get", key, len(blob or b""))
        return None if blob is None else memoryview(blob)

    def list(self, prefix: str, *, offset: str | None = None):
        self._request("get", prefix + "x")
        with self._lock:
            keys = sorted(k for k in self.objects if k.startswith(prefix) and (offset is None or k > offset))
        return [{"path": k} for k in keys]

    def list_dirs(self, prefix: str) -> list[str]:
        self._request("get", prefix.rstrip("/") + "/x")
        with self._lock:
            return sorted({prefix.rstrip("/") + "/" + k[len(prefix.rstrip("/")) + 1:].split("/")[0]
                           for k in self.objects if k.startswith(prefix.rstrip("/") + "/")})

    def delete(self, key: str) -> None:
        self._request("put", key)
        with self._lock:
            self.objects.pop(key, None)

    def delete_many(self, keys: list[str]) -> None:
        for batch in range(0, len(keys), self.bulk_delete):
            self._request("put", keys[batch])
        with self._lock:
            for key in keys:
                self.objects.pop(key, None)


def one(n: int) -> dict[str, Any]:
    import importlib
    import importlib.util

    threading.stack_size(512 * 1024)  # up to 64 pool threads per replica, 256 replicas, one process

    import torch

    clock = VirtualClock()
    patched = [importlib.import_module(f"diloco_replica.{m}") for m in REPLICA_MODULES
               if present(f"diloco_replica.{m}")]  # a BENCH_COMPARE revision may lack some
    for module in patched:
        module.time = clock
    repairs = next(m for m in patched if m.__name__.endswith("repairs"))
    repairs.threading = virtual_events(clock)  # the watcher paces itself with Event.wait(timeout)
    scheduler = threading.Thread(target=clock.run, daemon=True)
    scheduler.start()
    from diloco_replica.round.allreduce import StoreAllReduce

    store = SimulatedS3(clock)
    run = f"scale-{n}"
    replicas = [StoreAllReduce(store, run, i, n, round_timeout=600, poll_interval=0.05, poll_max=1.0)
                for i in range(n)]
    deltas = [torch.randn(ELEMENTS, generator=torch.Generator().manual_seed(i)) for i in range(n)]
    results: dict[tuple[int, int], Any] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(n + 1)

    def replica(i: int) -> None:
        try:
            for r in (1, 2):
                start.wait()
                results[(r, i)] = replicas[i].run_round(r, deltas[i].clone())
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            start.abort()

    threads = [threading.Thread(target=replica, args=(i,), daemon=True) for i in range(n)]
    t0 = real_time.monotonic()
    for t in threads:
        t.start()
    try:
        start.wait()  # round 1: the warm-up
        start.wait()  # round 2: measured from here
    except threading.BrokenBarrierError:
        pass
    store.reset_peaks()
    for t in threads:
        t.join()
    for ar in replicas:
        ar.close()
    clock.stop()
    import time as stdlib_time

    for module in patched:
        module.time = stdlib_time
    repairs.threading = threading
    if errors:
        raise SystemExit(f"N = {n}: {errors[0]!r}")
    rows = [results[(2, i)] for i in range(n)]
    assert all(torch.equal(rows[0].mean, r.mean) for r in rows), "replicas disagree on the mean"
    req = [r.traffic.puts + r.traffic.gets + r.traffic.lists + r.traffic.deletes - r.traffic.polls for r in rows]
    return {"replicas": n, "round_s": round(max(r.seconds for r in rows), 3),
            "requests_per_replica_per_round": max(req), "polls_per_replica_per_round": max(r.traffic.polls for r in rows),
            "peak_prefix_requests_per_s": max(store.peak.values()), "peak_prefix_puts_per_s": store.peak["put"],
            "peak_prefix_gets_per_s": store.peak["get"], "hottest_prefix": store.hottest,
            "slowdowns_503": store.slowdowns,
            "real_s": round(real_time.monotonic() - t0, 1)}


def main() -> None:
    if os.environ.get("BENCH_ONE"):  # a row for BENCH_COMPARE, in a process running that revision's code
        print(json.dumps(one(int(os.environ["BENCH_ONE"]))))
        return
    rows = []
    with ExitStack() as stack:
        src = baseline_sources(stack, COMPARE) if COMPARE else []
        for n in REPLICAS:
            if COMPARE and n <= COMPARE_MAX:
                env = {**os.environ, "BENCH_ONE": str(n), "PYTHONPATH": os.pathsep.join(src)}
                proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=3600)
                if proc.returncode != 0:
                    raise SystemExit(f"baseline N = {n}: {proc.stderr[-2000:]}")
                rows.append({"code": f"baseline {COMPARE}", **json.loads(proc.stdout)})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            rows.append({"code": "current", **one(n)})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    for code in {r["code"] for r in rows}:
        mine = [r for r in rows if r["code"] == code]
        base = next((r for r in mine if r["replicas"] == 8), mine[0])
        for r in mine:
            r["round_vs_n8"] = round(r["round_s"] / base["round_s"], 2)
    if os.environ.get("BENCH_PNG"):
        plot(rows, os.environ["BENCH_PNG"])
    json.dump({"bench": "scale", "elements_per_replica": ELEMENTS, "latency_s": LATENCY_S,
               "bandwidth_bytes_per_s": BANDWIDTH, "prefix_limits": {"put": PUT_RATE, "get": GET_RATE},
               "rows": rows, "targets": {"round_vs_n8 at 256": "<= 2", "peak_prefix_requests_per_s": "<= 3500"}},
              sys.stdout, indent=1)
    print()


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Round time, requests per replica and the busiest prefix's rate against N (log scales)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    ns = sorted({r["replicas"] for r in rows})
    panels = [("round_s", "round time (virtual s)", None, ""),
              ("requests_per_replica_per_round", "requests per replica per round", [2 * n + 6 for n in ns], "2N + 6"),
              ("peak_prefix_requests_per_s", "busiest prefix, requests/s", [PUT_RATE] * len(ns), "3,500/s")]
    for ax, (key, title, target, label) in zip(axes, panels):
        for code in sorted({r["code"] for r in rows}):
            mine = sorted((r["replicas"], r[key]) for r in rows if r["code"] == code)
            ax.plot([n for n, _ in mine], [v for _, v in mine], "--" if code.startswith("baseline") else "-",
                    marker="o", label=code)
        if target:
            ax.plot(ns, target, ":", color="grey", label=label)
        ax.set(title=title, xlabel="replicas N", xscale="log", yscale="log")
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
