"""All-reduce round time: the file:// object store vs torch.distributed gloo, same script.

For N = 2, 4 processes and 1 / 10 / 100 MB of fp32 per replica, each process times
`dist.all_reduce` (gloo over loopback TCP) and one store round (`StoreAllReduce.reduce`:
reduce-scatter + all-gather through files) on the same tensor. Per configuration the time of
a round is the slowest replica's; the median over repeats is reported. Prints JSON.
Target: store/gloo ratio ≤ 1.0 at 100 MB, N = 4.

BENCH_PART_MB (default "65536,32"): the store round once per `[diloco] part_mb`, alternating in
each repeat (`store_file_s_by_part_mb`; the last is `store_file_s`): one object per shard against
shards over 32 MiB cut into parts that pipeline.

BENCH_FINITE=1 also times each store round with the finiteness checks (`diloco_replica.transport.finite`:
every contribution, every mean, every reduced shard read) switched off, interleaved with the
checked rounds, and reports `finite_check_ratio` = checked / unchecked; and, since a busy
machine's I/O noise can drown a few percent, the same ratio for a round's compute alone
(`compute_check_ratio`: verify, sum, encode and decode one replica's share, no store).
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

from _common import knob  # noqa: E402 - bench/ is the script's directory

REPEATS = int(knob("BENCH_REPEATS", "3", "1"))
SIZES_MB = [int(x) for x in knob("BENCH_SIZES_MB", "1,10,100", "1").split(",")]
WORLDS = [int(x) for x in knob("BENCH_WORLDS", "2,4", "2").split(",")]
FINITE = os.environ.get("BENCH_FINITE") == "1"
# `[diloco] part_mb` of the store rounds, alternating in each repeat: 65536 sends each shard as one
# object (P = 1), the default 32 cuts a shard over 32 MiB into parts that pipeline. The last is
# the row's `store_file_s`.
PART_MBS = [float(x) for x in knob("BENCH_PART_MB", "65536,32", "32").split(",")]


def finite_checks(on: bool) -> None:
    """Switch the replica's finiteness checks on or off (off: every vector counts as finite)."""
    from diloco_replica.transport import finite
    from diloco_replica.round.steps import reduce, repairs

    real = finite.__dict__.setdefault("_real_all_finite", finite.all_finite)
    check = real if on else (lambda x: True)
    for module in (finite, reduce, repairs):
        module.all_finite = check


def round_compute(world: int, numel: int, repeats: int = 7) -> dict:
    """One replica's CPU work in a round, without the store: verify and sum the N−1 contributions
    to its shard (plus its own), encode, pack and decode the mean, then verify, check and copy out
    the N−1 other reduced shards. Min over interleaved repeats (noise only adds), checks on/off."""
    from types import SimpleNamespace

    from diloco_replica.transport.finite import Contribution, accumulate
    from diloco_replica.round.steps.repairs import RepairDesk
    from diloco_replica.transport.wire import Identity, decode_tensor, encode_tensor, joined, pack, unpack

    torch.set_num_threads(1)
    shard = numel // world
    own = torch.randn(shard)
    blobs = [joined(pack(Identity("b", 1, "scatter", 0, m), encode_tensor(torch.randn(shard), "fp32"), codec="fp32",
                         numel=shard)) for m in range(1, world)]
    reduced = [joined(pack(Identity("b", 1, "reduced", j, -1), encode_tensor(torch.randn(shard), "fp32"),
                           codec="fp32", numel=shard)) for j in range(1, world)]
    desk, out = SimpleNamespace(io=SimpleNamespace(n=world)), torch.empty(numel)

    def once() -> float:
        t0 = time.perf_counter()
        objs = [unpack(b, Identity("b", 1, "scatter", 0, m + 1), "k", numel=shard, codec="fp32")
                for m, b in enumerate(blobs)]
        parts = [Contribution(0, "k", lambda: own)] + [Contribution(m + 1, "k", o.tensor) for m, o in enumerate(objs)]
        summed = accumulate(parts, shard)
        blob = pack(Identity("b", 1, "reduced", 0, -1), encode_tensor(summed.total.div_(world), "fp32"), codec="fp32",
                    numel=shard)
        mean = decode_tensor(blob[1], "fp32", shard)
        if not summed.finite:  # as the reducer does: an fp32 mean of a finite total needs no second look
            finite_module().all_finite(mean)
        out[:shard] = mean
        for j, b in enumerate(reduced):
            obj = unpack(b, Identity("b", 1, "reduced", j + 1, -1), "k", numel=shard, codec="fp32")
            out[(j + 1) * shard:(j + 2) * shard] = RepairDesk._usable(desk, obj, None)
        return time.perf_counter() - t0

    times = {True: [], False: []}
    for _ in range(repeats):
        for on in (True, False):
            finite_checks(on)
            times[on].append(once())
    finite_checks(True)
    c, u = min(times[True]), min(times[False])
    return {"compute_checked_s": round(c, 4), "compute_unchecked_s": round(u, 4), "compute_check_ratio": round(c / u, 3)}


def finite_module():
    from diloco_replica.transport import finite

    return finite


def worker(rank: int, world: int, numel: int, port: int, store_dir: str, queue) -> None:
    import torch.distributed as dist

    from diloco.store.objectstore import open_store
    from diloco_replica.round.allreduce import StoreAllReduce

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
    unchecked, store_times = [], {part_mb: [] for part_mb in PART_MBS}
    for rep in range(REPEATS + 1):
        for k, part_mb in enumerate(PART_MBS):
            last = k == len(PART_MBS) - 1
            for on in (True, False) if FINITE and last else (True,):
                finite_checks(on)
                ar = StoreAllReduce(store, f"bench-{rep}-{k}-{int(on)}", rank, world, round_timeout=120,
                                    poll_interval=0.002, poll_max=0.02, part_mb=part_mb)
                dist.barrier()
                t0 = time.perf_counter()
                ar.run_round(1, x)
                (store_times[part_mb] if on else unchecked).append(time.perf_counter() - t0)
                ar.close()
    dist.barrier()
    dist.destroy_process_group()
    queue.put((rank, gloo[1:], {m: t[1:] for m, t in store_times.items()}, unchecked[1:]))  # first: warm-up


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
    g = statistics.median(gloo)
    by_part = {m: statistics.median(max(r[2][m][i] for r in rows) for i in range(REPEATS)) for m in PART_MBS}
    s = by_part[PART_MBS[-1]]
    row = {"world": world, "mb": mb, "gloo_s": round(g, 4), "store_file_s": round(s, 4),
           "ratio_store_vs_gloo": round(s / g, 2),
           "store_file_s_by_part_mb": {f"{m:g}": round(t, 4) for m, t in by_part.items()}}
    if FINITE:
        u = statistics.median(max(r[3][i] for r in rows) for i in range(REPEATS))
        row.update(store_unchecked_s=round(u, 4), finite_check_ratio=round(s / u, 3),
                   **round_compute(world, numel))
    return row


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
