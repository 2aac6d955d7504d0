"""Bytes per replica per round against the reduce-scatter lower bound, per transport codec.

N replicas (threads, in-memory store) reduce S bytes of fp32 each. The bound with fp32 on the
wire: up S, down 2(N−1)/N·S per replica. Reports measured / bound for every codec; fp16 and
bf16 should be ~0.5, int8 ~0.25 (plus one fp32 scale per 2048 values), int4 ~0.127; topk at
density d about 3·d·(2(N−1)/N + N)/10 of fp32's total at N = 4 (the means are the union of the
members' supports; random Δ gives the worst case, disjoint supports). Counts every object byte
the all-reduce layer moves, headers and membership records included. Prints JSON.
"""

from __future__ import annotations

import json
import os
import threading
import uuid

import torch

from diloco.store.objectstore import open_store
from diloco_replica.round.allreduce import StoreAllReduce

WORLD = int(os.environ.get("BENCH_WORLD", "4"))
from _common import knob  # noqa: E402 - bench/ is the script's directory

MB = int(knob("BENCH_MB", "16", "1"))


def one_round(codec: str, density: float = 0.01) -> list[dict]:
    store = open_store(f"memory://{uuid.uuid4().hex}")
    numel = MB * 1_000_000 // 4
    out = [None] * WORLD

    def go(rank: int) -> None:
        ar = StoreAllReduce(store, "bytes", rank, WORLD, codec=codec, round_timeout=60, poll_interval=0.001,
                            topk_density=density)
        out[rank] = ar.run_round(1, torch.randn(numel)).traffic
        ar.close()

    threads = [threading.Thread(target=go, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [{"up": t.bytes_up, "down": t.bytes_down, "requests": t.puts + t.gets + t.lists} for t in out]


def main() -> None:
    S = MB * 1_000_000
    up_bound, down_bound = S, 2 * (WORLD - 1) / WORLD * S
    rows = []
    for codec, density in [("fp32", 0), ("bf16", 0), ("fp16", 0), ("int8", 0), ("int4", 0), ("topk", 0.01),
                           ("topk", 0.02), ("topk", 0.03)]:
        per = one_round(codec, density)
        up = max(p["up"] for p in per)
        down = max(p["down"] for p in per)
        rows.append({"codec": codec + (f"@{density:g}" if density else ""), "bytes_up": up, "bytes_down": down,
                     "up_vs_fp32_bound": round(up / up_bound, 4), "down_vs_fp32_bound": round(down / down_bound, 4),
                     "total_vs_fp32_bound": round((up + down) / (up_bound + down_bound), 4),
                     "max_requests_per_replica": max(p["requests"] for p in per)})
    print(json.dumps({"bench": "bytes", "world": WORLD, "mb_per_replica": MB, "bound_up": up_bound,
                      "bound_down": down_bound, "results": rows,
                      "target": "fp32 within 5% of the bound; fp16 ~half; int8 ~quarter; int4 <= 1/8; topk at 1-3% <= 1/30"}, indent=2))


if __name__ == "__main__":
    main()
