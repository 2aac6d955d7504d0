"""What one round costs a replica: host memory, requests, and time against a raw transfer.

N replicas (real processes, one lane each) run DiLoCo on a plain module of S MB of fp32 through
file:// and s3:// (moto's server: a real S3 API over HTTP on 127.0.0.1). After a warm-up round,
per (store, N), in the same run:

- added_host_memory_vs_model: peak RSS during the rounds (VmHWM, reset once `DiLoCo(...)` is
  built) minus RSS just before `DiLoCo(...)` was built, over the fp32 model's bytes; the
  largest replica's. θ_global and the outer momentum (2×) are in it; the model is the user's.
  held_between_rounds_vs_model: the same right after `DiLoCo(...)` is built: θ_global, the
  momentum and the runtime's fixed part (obstore's runtime, threads; ~50 MB here), so the
  difference is what a round adds. Workers get the environment a launcher gives replicas
  (`diloco.inputs.replicaenv.REPLICA_ENV_DEFAULTS`). The rounds run with `exchange = "thread"`, so this
  one process holds all of a replica's memory; with the default sync process the same buffers
  live there instead, plus the snapshot buffer the two share (one lane-sized fp32 vector).
- requests_per_replica_per_round: billed requests of the measured round (PUT, GET, LIST,
  DELETE), polls left out; polls_per_replica_per_round: the GETs and LISTs made while waiting
  for others (their number follows the wait, not the protocol). The largest replica's.
- round_vs_raw: the slowest replica's `DiLoCo.step()` for the round (upload, membership,
  reduce, gather, outer step) against the same bytes moved by plain puts and gets with the
  same parallelism and no protocol, measured right after in the same processes.

`BENCH_PART_MB` (default "65536,32"): each row once per `[diloco] part_mb`, in the same run —
65536 sends every shard as one object (P = 1), 32 cuts a shard over 32 MiB into parts whose
fold, upload and download pipeline. `BENCH_COMPARE=<git rev>` also runs every row on that revision's code (a `git worktree` of it,
workers import its packages), alternating with the current code, so "before" and "after" come
from the same run on the same machine. `BENCH_QUICK=1`: 4 MB, N = 2 (a smoke run).

    .venv/bin/python bench/round_cost.py
    BENCH_COMPARE=HEAD~3 BENCH_MB=100 .venv/bin/python bench/round_cost.py
    BENCH_PNG=docs/round-cost.png ...     # also plot memory and requests against N, per store and code
Prints JSON rows {store, replicas, model_mb, added_host_memory_vs_model,
requests_per_replica_per_round, polls_per_replica_per_round, round_vs_raw, ...}.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

from _common import baseline_sources, knob, peak_rss_kb, reset_peak_rss, rss_kb  # noqa: E402 - bench/ is the script's directory

MB = float(knob("BENCH_MB", "100", "4"))
REPLICAS = [int(x) for x in knob("BENCH_REPLICAS", "2,4,8", "2").split(",")]
STORES = os.environ.get("BENCH_STORES", "file,s3").split(",")
COMPARE = os.environ.get("BENCH_COMPARE", "")
# `[diloco] part_mb` per row: 65536 sends each shard as one object (P = 1, the layout before
# parts), the default 32 cuts shards over 32 MiB into parts that pipeline; both in the same run.
PART_MBS = [float(x) for x in knob("BENCH_PART_MB", "65536,32", "32").split(",")]
ROOT = Path(__file__).resolve().parent.parent


def raw_round(store, run: str, rank: int, n: int, numel: int, barrier) -> float:
    """This replica's round bytes with plain puts and gets: S up, 2(N−1)/N·S down."""
    from diloco_replica.round.layout import shard_bounds

    import torch

    bounds = shard_bounds(numel, n)
    payload = torch.randn(numel).numpy().tobytes()
    part = lambda j: payload[bounds[j][0] * 4: bounds[j][1] * 4]  # noqa: E731
    pool = ThreadPoolExecutor(max_workers=max(2, min(8, 2 * n)))
    barrier.wait()
    t0 = time.perf_counter()
    puts = [pool.submit(store.put, f"{run}/raw/scatter/{j}/{rank}", part(j)) for j in range(n) if j != rank]
    puts.append(pool.submit(store.put, f"{run}/raw/reduced/{rank}", part(rank)))
    for f in puts:
        f.result()
    barrier.wait()
    gets = [pool.submit(store.get, f"{run}/raw/scatter/{rank}/{m}") for m in range(n) if m != rank]
    gets += [pool.submit(store.get, f"{run}/raw/reduced/{j}") for j in range(n) if j != rank]
    got = sum(f.result().nbytes for f in gets)
    elapsed = time.perf_counter() - t0
    assert got == 2 * len(part(rank)) * (n - 1) or n == 1, got
    pool.shutdown()
    return elapsed


def worker(rank: int, n: int, uri: str, env: dict, src: list[str], run: str, part_mb: float | None, barrier,
           queue) -> None:
    os.environ.update(env)
    sys.path[:0] = src  # the code under test (a baseline worktree's packages, or nothing: the installed ones)
    import torch

    from diloco.bootstrap.context import ReplicaContext
    from diloco.store.objectstore import open_store
    from diloco_replica import DiLoCo

    torch.set_num_threads(1)
    numel = int(MB * 1024 * 1024) // 4
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.randn(numel))
    before = rss_kb()
    ctx = ReplicaContext(rank, n, run, rendezvous=uri,
                         settings={"sync_every": 1, "round_timeout": 600, "checkpoint_every": 1000,
                                   "exchange": "thread", **({} if part_mb is None else {"part_mb": part_mb})})  # the whole replica in this process: its RSS is all of it
    diloco = DiLoCo(model, None, ctx)
    built = rss_kb()  # θ_global and the momentum (2×) plus what the runtime itself holds (obstore, threads)
    reset_peak_rss()
    times, rows = [], []
    for _ in range(2):  # a warm-up round, then the measured one
        with torch.no_grad():
            model.w.add_(0.01 * (rank + 1))
        barrier.wait()
        t0 = time.perf_counter()
        rows.append(diloco.step())
        times.append(time.perf_counter() - t0)
    peak = peak_rss_kb()
    diloco.close()
    raw = raw_round(open_store(uri), run, rank, n, numel, barrier)
    req = rows[-1].requests
    queue.put({"rank": rank, "round_s": times[-1], "raw_s": raw, "added_kb": peak - before, "built_kb": built - before,
               "requests": req["puts"] + req["gets"] + req["lists"] + req["deletes"] - req["polls"],
               "polls": req["polls"], "by_kind": req,
               "bytes_up": rows[-1].bytes_up, "bytes_down": rows[-1].bytes_down})


def _result(queue, procs, limit: float = 1800.0) -> dict:
    """The next worker's result; a worker that died without one stops the bench at once (its
    traceback is on stderr) instead of leaving it waiting out `limit`."""
    import queue as queues

    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            return queue.get(timeout=1.0)
        except queues.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise SystemExit(f"round_cost: a replica worker died (exit {dead[0].exitcode}); see its traceback above")
    raise SystemExit(f"round_cost: no result from the replicas in {limit:g}s")


def one(uri: str, env: dict, n: int, src: list[str], run: str, part_mb: float | None) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue, barrier = ctx.Queue(), ctx.Barrier(n)
    procs = [ctx.Process(target=worker, args=(i, n, uri, env, src, run, part_mb, barrier, queue)) for i in range(n)]
    for p in procs:
        p.start()
    got = [_result(queue, procs) for _ in procs]
    for p in procs:
        p.join(60)
    size = MB * 1024 * 1024
    worst = max(got, key=lambda g: g["requests"])
    round_s, raw_s = max(g["round_s"] for g in got), max(g["raw_s"] for g in got)
    return {"replicas": n, "model_mb": MB,
            "added_host_memory_vs_model": round(max(g["added_kb"] for g in got) * 1024 / size, 2),
            "held_between_rounds_vs_model": round(max(g["built_kb"] for g in got) * 1024 / size, 2),
            "requests_per_replica_per_round": worst["requests"],
            "polls_per_replica_per_round": max(g["polls"] for g in got),
            "requests_by_kind": worst["by_kind"],
            "round_vs_raw": round(round_s / raw_s, 3), "round_s": round(round_s, 3), "raw_s": round(raw_s, 3),
            "bytes_up_vs_bound": round(got[0]["bytes_up"] / size, 4),
            "bytes_down_vs_bound": round(got[0]["bytes_down"] / (2 * (n - 1) / n * size), 4)}


def main() -> None:
    from diloco.inputs.replicaenv import REPLICA_ENV_DEFAULTS

    os.environ.update(REPLICA_ENV_DEFAULTS)  # what a launcher gives every replica (glibc reads it at exec)
    out = {"model_mb": MB, "cpu_count": os.cpu_count(), "rows": []}
    with ExitStack() as stack:
        codes = [(f"current, part_mb {part_mb:g}", [], part_mb) for part_mb in PART_MBS]  # (label, sources, part_mb)
        if COMPARE:  # code from before parts: no `part_mb` setting
            codes.insert(0, (f"baseline {COMPARE}", baseline_sources(stack, COMPARE), None))
        for store in STORES:
            if store == "file":
                uri, env = f"file://{stack.enter_context(tempfile.TemporaryDirectory())}/store", {}
            else:
                from diloco.testing.s3server import moto_s3

                s3 = stack.enter_context(moto_s3())
                uri, env = s3["uri"], s3["env"]
            for n in REPLICAS:
                for label, src, part_mb in codes:
                    run = f"cost-{n}-{len(out['rows'])}"
                    row = {"store": store, "code": label, "part_mb": part_mb, **one(uri, env, n, src, run, part_mb)}
                    out["rows"].append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
    if os.environ.get("BENCH_PNG"):
        plot(out["rows"], Path(os.environ["BENCH_PNG"]))
    json.dump(out, sys.stdout, indent=1)
    print()


def plot(rows: list[dict], path: Path) -> None:
    """Added host memory and requests per replica per round against N, a line per store and code."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, req) = plt.subplots(1, 2, figsize=(10, 3.8))
    for store in sorted({r["store"] for r in rows}):
        for code in sorted({r["code"] for r in rows}):
            pts = sorted((r["replicas"], r) for r in rows if r["store"] == store and r["code"] == code)
            if not pts:
                continue
            ns = [n for n, _ in pts]
            style = "--" if code.startswith("baseline") else "-"
            label = f"{store}, {code}"
            mem.plot(ns, [r["added_host_memory_vs_model"] for _, r in pts], style, marker="o", label=label)
            req.plot(ns, [r["requests_per_replica_per_round"] for _, r in pts], style, marker="o", label=label)
    ns = sorted({r["replicas"] for r in rows})
    req.plot(ns, [2 * n + 6 for n in ns], ":", color="grey", label="target 2N + 6")
    mem.axhline(2.5, linestyle=":", color="grey", label="target 2.5×")
    mem.set(title=f"host memory DiLoCo adds ({rows[0]['model_mb']:g} MB fp32 model)", xlabel="replicas N",
            ylabel="× the model")
    req.set(title="requests per replica per round (polls apart)", xlabel="replicas N", ylabel="requests")
    for ax in (mem, req):
        ax.set_xticks(ns)
        ax.grid(alpha=0.3)
    req.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
