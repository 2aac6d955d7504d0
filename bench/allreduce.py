"""All-reduce round time: the file:// object store vs torch.distributed gloo, same script.

For N = 2, 4 processes and 1 / 10 / 100 MB of fp32 per replica, each process times
`dist.all_reduce` (gloo over loopback TCP) and one store round (`StoreAllReduce.reduce`:
reduce-scatter + all-gather through files) on the same tensor. Per configuration the time of
a round is the slowest replica's; the median over repeats is reported. Prints JSON.
Target: store/gloo ratio ≤ 1.0 at 100 MB, N = 4.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

REPEATS = int(os.environ.get("BENCH_REPEATS", "3"))
SIZES_MB = [int(x) for x in os.environ.get("BENCH_SIZES_MB", "1,10,100").split(",")]
WORLDS = [int(x) for x in os.environ.get("BENCH_WORLDS", "2,4").split(",")]


def worker(rank: int, world: int, numel: int, port: int, store_dir: str, queue) -> None:
    import torch.distributed as dist

    from diloco.store import open_store
    from diloco_replica.allreduce import StoreAllReduce

    torch.set_num_threads(1)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    gloo, store_times = [], []
    for rep in range(REPEATS + 1):
        y = x.clone()
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(y)
        gloo.append(time.perf_counter() - t0)
    store = open_store(f"file://{store_dir}")
    for rep in range(REPEATS + 1):
        ar = StoreAllReduce(store, f"bench-{rep}", rank, world, round_timeout=120, poll_interval=0.002, poll_max=0.02)
        dist.barrier()
        t0 = time.perf_counter()
        ar.run_round(1, x)
        store_times.append(time.perf_counter() - t0)
        ar.close()
    dist.barrier()
    dist.destroy_process_group()
    queue.put((rank, gloo[1:], store_times[1:]))  # first of each is warm-up


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, mb: int, port: int) -> dict:
    numel = mb * 1_000_000 // 4
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="diloco-bench-") as store_dir:
        procs = [ctx.Process(target=worker, args=(r, world, numel, port, store_dir, queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        rows = [queue.get(timeout=600) for _ in procs]
        for p in procs:
            p.join()
    gloo = [max(r[1][i] for r in rows) for i in range(REPEATS)]
    store = [max(r[2][i] for r in rows) for i in range(REPEATS)]
    g, s = statistics.median(gloo), statistics.median(store)
    return {"world": world, "mb": mb, "gloo_s": round(g, 4), "store_file_s": round(s, 4), "ratio_store_vs_gloo": round(s / g, 2)}


def main() -> None:
    results = []
    for world in WORLDS:
        for mb in SIZES_MB:
            results.append(run(world, mb, free_port()))
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"bench": "allreduce", "repeats": REPEATS, "cpus": os.cpu_count(), "results": results,
                      "target": "ratio_store_vs_gloo <= 1.0 at 100 MB, world 4"}, indent=2))


if __name__ == "__main__":
    main()
