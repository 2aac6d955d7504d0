"""Lanes: one round at S MB per replica, N = 2 replicas, L = 1, 2, 4 processes per replica.

Each replica is L real processes in a gloo group, each running DiLoCo on a plain module of
S MB (replicated in every process, as with DDP): lane k syncs 1/L of it through the store, then
the lanes are broadcast inside the replica. Per (store, L), in the same run:

- round_s: the slowest process's `DiLoCo.step()` for one sync round (after a warm-up round),
  all of it: upload, membership, reduce, gather, outer step, the in-replica broadcast;
- raw_s: the same bytes moved by plain puts and gets with the same parallelism and no protocol
  (each lane puts S/L, waits for every lane of every replica, gets 2(N−1)/N·S/L);
- overhead = round_s / raw_s (target ≤ 1.3×), and the round time against L = 1;
- bytes per replica and per lane, against the bound S up and 2(N−1)/N·S down;
- host memory: per replica, the peak RSS of its processes above what they held before DiLoCo
  started (the model itself is the user's), summed, against the fp32 model size (target ≤ 3×).

Stores: file:// and s3:// on a moto server (a real S3 API over HTTP on 127.0.0.1); file:// only in
quick mode (the smoke run CI makes: round_cost.py's smoke run takes rounds through s3://). Workers of
L > 1 get the environment a launcher gives such replicas (`GROUP_ENV_DEFAULTS`);
BENCH_MALLOC=glibc measures without it.
    python bench/lanes.py                 # S = 100 MB
    BENCH_MB=20 BENCH_LANES=1,2 BENCH_STORES=file python bench/lanes.py
Prints JSON.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.multiprocessing as mp

from _common import knob, peak_rss_kb, rss_kb  # noqa: E402 - bench/ is the script's directory

MB = int(knob("BENCH_MB", "100", "4"))
LANES = [int(x) for x in knob("BENCH_LANES", "1,2,4", "1,2").split(",")]
STORES = knob("BENCH_STORES", "file,s3", "file").split(",")  # quick: s3 rounds are smoke-run by round_cost.py
N = 2


def raw_round(store, run: str, rank: int, lane: int, lanes: int, numel: int, barrier) -> float:
    """The lane's share of the round's bytes with plain puts and gets, same pool width as the protocol."""
    from diloco_replica.round.layout import shard_bounds

    bounds = shard_bounds(numel, N)
    payload = torch.randn(numel).numpy().tobytes()
    size = lambda j: (bounds[j][1] - bounds[j][0]) * 4  # noqa: E731
    off = lambda j: bounds[j][0] * 4  # noqa: E731
    pool = ThreadPoolExecutor(max_workers=max(2, min(8, 2 * N)))
    barrier.wait()
    t0 = time.perf_counter()
    puts = [pool.submit(store.put, f"{run}/raw/{lane}/scatter/{j}/{rank}", payload[off(j):off(j) + size(j)])
            for j in range(N) if j != rank]
    puts.append(pool.submit(store.put, f"{run}/raw/{lane}/reduced/{rank}", payload[off(rank):off(rank) + size(rank)]))
    for f in puts:
        f.result()
    barrier.wait()
    gets = [pool.submit(store.get, f"{run}/raw/{lane}/scatter/{rank}/{m}") for m in range(N) if m != rank]
    gets += [pool.submit(store.get, f"{run}/raw/{lane}/reduced/{j}") for j in range(N) if j != rank]
    got = sum(f.result().nbytes for f in gets)
    elapsed = time.perf_counter() - t0
    assert got == 2 * size(rank) * (N - 1), got  # the others' parts of this lane's shard, and their reduced shards
    pool.shutdown()
    return elapsed


def worker(index: int, lanes: int, uri: str, env: dict, ports: list[int], barrier, queue) -> None:
    os.environ.update(env)  # (the malloc default a launcher sets for L > 1 is given by `one`, before exec)
    rank, lane = divmod(index, lanes)
    import torch.distributed as dist

    from diloco.bootstrap.context import ReplicaContext
    from diloco.store.objectstore import open_store
    from diloco_replica import DiLoCo

    torch.set_num_threads(1)
    if lanes > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[rank]}", rank=lane, world_size=lanes)
    numel = MB * 1024 * 1024 // 4
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.randn(numel))
    before = rss_kb()
    run = f"lanes-{lanes}"
    ctx = ReplicaContext(rank, N, run, rendezvous=uri, lane=lane, lanes=lanes,
                         settings={"sync_every": 1, "round_timeout": 300, "checkpoint_every": 1000,
                                   "exchange": "thread"})  # in this process: its lane's traffic is counted here
    diloco = DiLoCo(model, None, ctx)
    times, rows = [], []
    for _ in range(2):  # a warm-up round, then the measured one
        with torch.no_grad():
            model.w.add_(0.01)
        barrier.wait()
        lane_before = diloco.sync.exchanger.allreduce.store.traffic.snapshot()
        t0 = time.perf_counter()
        info = diloco.step()
        times.append(time.perf_counter() - t0)
        rows.append(info)
        lane_round = diloco.sync.exchanger.allreduce.store.traffic.since(lane_before)
    diloco.close()
    peak = peak_rss_kb()
    raw = raw_round(open_store(uri), run, rank, lane, lanes, diloco.view.numel, barrier)
    queue.put({"rank": rank, "lane": lane, "round_s": times[-1], "raw_s": raw,
               "replica_bytes_up": rows[-1].bytes_up, "replica_bytes_down": rows[-1].bytes_down,
               "lane_requests": sum(rows[-1].requests.values()) / lanes,
               "lane_bytes_round": lane_round.bytes_up + lane_round.bytes_down,
               "overhead_kb": peak - before})
    if lanes > 1:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one(uri: str, env: dict, lanes: int) -> dict:
    ctx = mp.get_context("spawn")
    queue, barrier = ctx.Queue(), ctx.Barrier(N * lanes)
    if lanes > 1 and os.environ.get("BENCH_MALLOC", "launcher") == "launcher":  # as replica_env sets it
        from diloco.inputs.replicaenv import GROUP_ENV_DEFAULTS

        os.environ.update(GROUP_ENV_DEFAULTS)  # glibc reads it at exec: the spawned workers see it
    else:
        for k in ("MALLOC_MMAP_THRESHOLD_",):
            os.environ.pop(k, None)
    ports = [free_port() for _ in range(N)]
    procs = [ctx.Process(target=worker, args=(i, lanes, uri, env, ports, barrier, queue)) for i in range(N * lanes)]
    for p in procs:
        p.start()
    got = [queue.get(timeout=900) for _ in procs]
    for p in procs:
        p.join(60)
    size = MB * 1024 * 1024
    round_s, raw_s = max(g["round_s"] for g in got), max(g["raw_s"] for g in got)
    per_replica_kb = [sum(g["overhead_kb"] for g in got if g["rank"] == r) for r in range(N)]
    up = got[0]["replica_bytes_up"]
    return {"lanes": lanes, "round_s": round(round_s, 3), "raw_s": round(raw_s, 3),
            "overhead_vs_raw": round(round_s / raw_s, 3),
            "bytes_up_per_replica_vs_bound": round(up / size, 4),
            "bytes_down_per_replica_vs_bound": round(got[0]["replica_bytes_down"] / (2 * (N - 1) / N * size), 4),
            "bytes_per_lane_mb": round(max(g["lane_bytes_round"] for g in got) / 2**20, 1),
            "requests_per_lane": max(g["lane_requests"] for g in got),
            "host_memory_vs_model": round(max(per_replica_kb) * 1024 / size, 2)}


def main() -> None:
    out = {"mb_per_replica": MB, "replicas": N, "cpu_count": os.cpu_count(), "results": {}}
    for store in STORES:
        rows = []
        if store == "file":
            with tempfile.TemporaryDirectory() as d:
                for lanes in LANES:
                    rows.append(one(f"file://{d}/store", {}, lanes))
        else:
            from diloco.testing.s3server import moto_s3

            with moto_s3() as s3:
                for lanes in LANES:
                    rows.append(one(s3["uri"], s3["env"], lanes))
        base = rows[0]["round_s"]
        for r in rows:
            r["round_vs_one_lane"] = round(r["round_s"] / base, 3)
        out["results"][store] = rows
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
