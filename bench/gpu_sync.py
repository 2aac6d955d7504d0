"""What a round costs the training loop on a GPU: DiLoCo's sync modes against compute alone.

N replicas share one device and train the GPT-shaped byte LM of examples/tiny-lm (default: dim
768, 12 layers, 12 heads, context 512, batch 16: 85.8M parameters, bf16 autocast, fused AdamW)
under `DiLoCo(model, opt, ctx)`, as the replica README shows, meeting through a file:// store on
the machine's disk. Per mode and H, in the same run:

- tokens_per_s: tokens trained by all replicas over the slowest one's loop up to its last inner
  step (rounds included); drain_s: what the loop's end added after it (overlap: the last round's
  merge, once per run); compute_only_tokens_per_s: the same loop without DiLoCo (the
  `compute-only` row, run first; every replica warms the GPU up before its clock starts).
- blocked_s_per_round: what the training loop waited per round (the rows' `sync_s`: snapshot,
  the wait for the exchange or for a late merge, the merge); blocked_share: of a round's wall time.
- step_inflation: the median inner step while a round was being exchanged over the median one
  while none was, minus 1 (overlap; a synchronous round runs no inner steps while it exchanges).
- raw_transfer_s: the same bytes as a round moves (up S, down 2(N−1)/N·S) by plain puts and gets
  through the same store, all replicas at once (the median of 3); blocked_vs_raw: blocked_s_per_round over it.
- step_bound_tokens_per_s: N replicas' tokens per step over the median inner step taken while no
  round was in flight (the issue's "compute alone": no data loading stalls, no stragglers);
  share_of_step_bound: tokens_per_s over it.
- eval_loss: θ_global's loss on held-out text at the end (equal steps for every row);
  eval_loss_vs_sync_fp32: over the same run's "sync fp32" row, minus 1.
- host memory per replica (`_common.HostMemory`: the Pss of its training process and any sync
  process, shared memory counted once, sampled every 0.1 s, over the same process just before
  `DiLoCo(...)`, with the model built and warmed up): host_join_gb, the peak while `DiLoCo(...)`
  joins the run (θ_0, the state from the store); host_train_gb, the peak while it trains, up to
  its last round (before the raw-transfer phase). The largest replica's. host_added_gb:
  host_train_gb over the compute-only row's (what training itself grows by over the same
  window), and host_added_x_model / host_join_x_model over the model's fp32 bytes: what DiLoCo
  holds on the host per replica, training and joining.

"sync fp32 whole-shards" sends each shard as one object (`part_mb = 65536`), the layout before
parts; "sync fp32" cuts shards over 32 MiB into parts that pipeline (the default). Rows named
"… (process)" run the exchange in a sync process beside each training process
(`exchange = "process"`); the others on a thread of the training process (the default). Rows
named "… fragments5" sync the model in 5 fragments (`fragments = 5`, a round every H/5 steps;
their blocked share is of those shorter rounds). "… delay5" rows merge 5 inner steps after the
snapshot (`overlap_delay = 5`), waiting for the round there if it has not arrived. Rows named "…
device-codec" run a quantised transport's arithmetic (error feedback, decoding, the fold, the
mean's encoding) on the GPU (`codec_device = "model"`); the others on the host's cores (the
default). row_wall_s: the row's wall time, start-up and raw transfer included.

Without CUDA the bench runs a proxy of what the GPU sees (`device: "cpu-proxy"`): an inner step is
BENCH_PROXY_STEP_S of sleep (the GPU's compute: it holds no interpreter) after BENCH_PROXY_LAUNCHES
tiny tensor operations (the Python work of launching a step's kernels, which needs the
interpreter), and the parameters move by a fixed small update; there is no loss. What the loop
loses to the exchange shows as it would on a GPU: waits, and steps slowed by a busy interpreter.

    python bench/gpu_sync.py                    # CUDA if present; prints {rows, targets} as JSON
    BENCH_QUICK=1 python bench/gpu_sync.py      # a smoke run: small model, few steps, two modes
    BENCH_ROWS="sync fp32,overlap int4" BENCH_H=50,200 BENCH_STEPS=400 BENCH_DIM=768 ...
    BENCH_ROWS_FILE=rows.jsonl ...              # also each row as it is done, one JSON line (a run cut short keeps them)

A row whose replicas fail is reported with its error and the rest go on.

Targets (issue "The sync, hidden on the GPU"): overlap modes blocked <= 5% of a round, steps
inflated <= 3%, tokens/s >= 0.95x compute-only; synchronous fp32 blocked <= 1.3x the raw transfer.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "examples" / "tiny-lm"))

from _common import QUICK, HostMemory, knob  # noqa: E402

MODES: dict[str, dict | None] = {
    "compute-only": None,
    "sync fp32": {},
    "sync fp32 whole-shards": {"part_mb": 65536},  # one object a shard (P = 1): the same-run baseline of parts
    "sync fp32 (process)": {"exchange": "process"},
    "overlap fp32": {"overlap": True},
    "overlap int4": {"overlap": True, "transport": "int4"},
    "overlap int4 (process)": {"overlap": True, "transport": "int4", "exchange": "process"},
    "overlap int4 device-codec": {"overlap": True, "transport": "int4", "codec_device": "model"},
    "sync int4": {"transport": "int4"},
    "sync int4 device-codec": {"transport": "int4", "codec_device": "model"},
    "overlap int4 no-feedback": {"overlap": True, "transport": "int4", "error_feedback": False},
    "overlap int4 delay5": {"overlap": True, "transport": "int4", "overlap_delay": 5},
    "overlap int4 delay25": {"overlap": True, "transport": "int4", "overlap_delay": 25},
    "overlap fp32 fragments5": {"overlap": True, "fragments": 5},
    "overlap int4 fragments5": {"overlap": True, "transport": "int4", "fragments": 5},
}
ROWS = [r for r in knob("BENCH_ROWS", ",".join(MODES), "compute-only,sync fp32,overlap int4 (process)").split(",") if r]
HS = [int(h) for h in knob("BENCH_H", "50", "10").split(",")]
STEPS = int(knob("BENCH_STEPS", "400", "30"))
N = int(knob("BENCH_REPLICAS", "2", "2"))
SHAPE = {"dim": int(knob("BENCH_DIM", "768", "64")), "layers": int(knob("BENCH_LAYERS", "12", "1")),
         "heads": int(knob("BENCH_HEADS", "12", "4")), "context": int(knob("BENCH_CONTEXT", "512", "32")),
         "batch": int(knob("BENCH_BATCH", "16", "8"))}
RAW_REPEATS = int(knob("BENCH_RAW_REPEATS", "3", "1"))
ROWS_FILE = os.environ.get("BENCH_ROWS_FILE")
PROXY = {"step_s": float(knob("BENCH_PROXY_STEP_S", "0.04", "0.02")),
         "launches": int(knob("BENCH_PROXY_LAUNCHES", "600", "200"))}


# -- one replica ------------------------------------------------------------------------------

def worker(spec: dict) -> dict:
    import torch

    from diloco.bootstrap.context import ReplicaContext
    from tiny_lm import TinyLM, batch, evaluate, load_corpus, loss_of

    cuda = spec["device"] == "cuda"
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        torch.set_num_threads(1)
    ctx = ReplicaContext.from_env()
    shape = spec["shape"]
    torch.manual_seed(0)
    model = TinyLM(dim=shape["dim"], layers=shape["layers"], heads=shape["heads"], context=shape["context"]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=4e-4, weight_decay=0.1, betas=(0.9, 0.95), fused=cuda)
    train, held_out = load_corpus(spec["max_bytes"]) if cuda else (None, None)
    gen = torch.Generator().manual_seed(ctx.rank)
    if cuda:  # kernels chosen, memory pooled and clocks up before the clock starts (parameters untouched)
        for _ in range(5):
            x, y = (t.to(device) for t in batch(train, shape["batch"], shape["context"], gen))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss_of(model, x, y).backward()
            model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    diloco = None
    memory = HostMemory()  # the base: this process, model built and warmed up, without DiLoCo
    if spec["settings"] is not None:
        from diloco_replica import DiLoCo

        diloco = DiLoCo(model, opt, ctx)
    host_join = memory.mark()
    params = [p for p in model.parameters()]
    nudges = [torch.full_like(p, 1e-4) for p in params] if not cuda else None
    tick = torch.zeros(1)
    tokens_per_step = shape["batch"] * shape["context"]
    barrier(spec["dir"], f"ready-{ctx.rank}", spec["replicas"])
    steps, rows = [], []
    start = time.perf_counter()
    step_iter = diloco.steps(spec["steps"]) if diloco else range(spec["steps"])
    for step in step_iter:
        in_flight = diloco is not None and diloco.in_flight
        t0 = time.perf_counter()
        if cuda:
            x, y = (t.to(device, non_blocking=True) for t in batch(train, shape["batch"], shape["context"], gen))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_of(model, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            value = loss.item()
        else:  # the proxy: the interpreter's share of a step, then the device's (sleeping: no interpreter)
            for _ in range(spec["proxy"]["launches"]):
                tick.add_(1)
            time.sleep(spec["proxy"]["step_s"])
            with torch.no_grad():
                torch._foreach_add_(params, nudges, alpha=1.0 if step % 2 == 0 else -0.5)
            value = None
        steps.append((time.perf_counter() - t0, in_flight))
        if diloco is not None:
            info = diloco.step(loss=value, tokens=tokens_per_step)
            if info is not None:
                rows.append({"round": info.round, "sync_s": info.sync_s, "hidden_s": info.hidden_s,
                             "phases": info.phases})
        last = time.perf_counter()
    if cuda:
        torch.cuda.synchronize()
    loop_s = time.perf_counter() - start
    host_train = memory.mark()
    memory.stop()
    out = {"rank": ctx.rank, "loop_s": last - start, "drain_s": loop_s - (last - start),
           "parameters": sum(p.numel() for p in params), "tokens": len(steps) * tokens_per_step, "rows": rows,
           "host_join_gb": host_join / 1e9, "host_train_gb": host_train / 1e9,
           "idle_steps": [s for s, f in steps if not f], "busy_steps": [s for s, f in steps if f]}
    if diloco is not None:
        diloco.close()
        import zlib

        out["theta_crc32"] = zlib.crc32(diloco.theta.numpy().tobytes())
        out["raw_transfer_s"] = raw_transfer(ctx, diloco.theta.numel() * 4, spec, RAW_REPEATS)
    if cuda:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out["eval_loss"] = evaluate(model, held_out.to(device), shape["context"])
        out["peak_gpu_gb"] = torch.cuda.max_memory_allocated() / 1e9
    return out


def raw_transfer(ctx, nbytes: int, spec: dict, repeats: int = 3) -> float:
    """A round's bytes by plain puts and gets, every replica at once: N shards of S/N up (N−1 to
    the others, one reduced), then 2(N−1) down, 8 requests in flight. The median of `repeats`
    (one transfer of a few hundred MB varies by 2× on a shared disk)."""
    from concurrent.futures import ThreadPoolExecutor

    n = spec["replicas"]
    shard = os.urandom(max(1, nbytes // n))
    times = []
    for k in range(repeats):
        key = lambda i, rank=ctx.rank, k=k: f"raw{k}/{rank}/{i}"  # noqa: E731
        barrier(spec["dir"], f"raw{k}-{ctx.rank}", n)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: ctx.store.put(key(i), shard), range(n)))
            barrier(spec["dir"], f"raw{k}-up-{ctx.rank}", n)
            others = [f"raw{k}/{(ctx.rank + 1 + j) % n}/{i}" for j in range(max(1, n - 1)) for i in range(2)]
            list(pool.map(ctx.store.get, others))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def barrier(where: str, name: str, count: int) -> None:
    Path(where, name).touch()
    prefix = name.rsplit("-", 1)[0] + "-"
    while sum(p.name.startswith(prefix) and p.name[len(prefix):].isdigit() for p in Path(where).iterdir()) < count:
        time.sleep(0.01)


# -- one row: N replicas of one mode ------------------------------------------------------------

def run_mode(name: str, H: int, device: str, tmp: Path) -> dict:
    settings = MODES[name]
    where = tmp / f"{name.replace(' ', '_').replace(',', '')}-{H}"
    where.mkdir()
    run_id = f"gpu-{uuid.uuid4().hex[:8]}"
    began = time.perf_counter()
    spec = {"device": device, "shape": SHAPE, "steps": STEPS, "replicas": N, "dir": str(where), "proxy": PROXY,
            "max_bytes": 20_000_000 if not QUICK else 2_000_000,
            "settings": None if settings is None else {"sync_every": H, "total_steps": STEPS, "round_timeout": 300,
                                                       "checkpoint_every": 1000, **settings}}
    from diloco.inputs.replicaenv import REPLICA_ENV_DEFAULTS

    procs = []
    for rank in range(N):
        # what a launcher gives every replica (its malloc settings: glibc reads them at exec), then the run's
        env = {**REPLICA_ENV_DEFAULTS, **os.environ, "REPLICA_RANK": str(rank), "DILOCO_REPLICAS": str(N), "DILOCO_RUN_ID": run_id,
               "DILOCO_RENDEZVOUS": f"file://{tmp / 'store'}", "DILOCO_SETTINGS": json.dumps(spec["settings"] or {}),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "bench"), os.environ.get("PYTHONPATH")]))}
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(spec)], env=env,
                                      stdout=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        stdout, _ = p.communicate(timeout=3600)
        if p.returncode != 0:
            failed = f"a replica failed (exit {p.returncode})"
        else:
            outs.append(json.loads(stdout.strip().splitlines()[-1]))
    shutil.rmtree(tmp / "store", ignore_errors=True)  # a 1B row's store holds tens of GB
    if len(outs) < N:
        return {"device": device, "mode": name, "H": H, "error": failed}
    return {**summarise(name, H, device, outs), "row_wall_s": round(time.perf_counter() - began, 1)}


def summarise(name: str, H: int, device: str, outs: list[dict]) -> dict:
    tokens = sum(o["tokens"] for o in outs)
    loop = max(o["loop_s"] for o in outs)
    idle = [s for o in outs for s in o["idle_steps"]]
    step_bound = N * SHAPE["batch"] * SHAPE["context"] / statistics.median(idle)
    row = {"device": device, "mode": name, "replicas": N, "H": H, "steps": STEPS, "tokens_per_s": round(tokens / loop),
           "step_bound_tokens_per_s": round(step_bound), "share_of_step_bound": round(tokens / loop / step_bound, 3),
           "parameters": outs[0]["parameters"], "eval_loss": outs[0].get("eval_loss"),
           "host_join_gb": round(max(o["host_join_gb"] for o in outs), 3),
           "host_train_gb": round(max(o["host_train_gb"] for o in outs), 3),
           "peak_gpu_gb": max((o["peak_gpu_gb"] for o in outs if "peak_gpu_gb" in o), default=None)}
    if name == "compute-only":
        return row
    assert len({o["theta_crc32"] for o in outs}) == 1, f"{name}: replicas disagree on θ_global"
    rounds = [r for o in outs for r in o["rows"]]
    blocked = statistics.mean(r["sync_s"] for r in rounds) if rounds else 0.0
    round_s = loop / max(1, STEPS * MODES[name].get("fragments", 1) / H)  # a round every H/K steps
    busy = [s for o in outs for s in o["busy_steps"]]
    raw = statistics.mean(o["raw_transfer_s"] for o in outs)
    row.update({"drain_s": round(max(o["drain_s"] for o in outs), 3), "blocked_s_per_round": round(blocked, 4), "blocked_share": round(blocked / round_s, 4),
                "round_s": round(round_s, 3), "step_s": round(statistics.median(idle), 4),
                "step_inflation": round(statistics.median(busy) / statistics.median(idle) - 1, 4) if busy else None,
                "raw_transfer_s": round(raw, 4), "blocked_vs_raw": round(blocked / raw, 2) if raw else None,
                "hidden_s_per_round": round(statistics.mean(r["hidden_s"] for r in rounds), 4) if rounds else 0.0,
                "phases_s_per_round": {k: round(statistics.mean(r["phases"].get(k, 0.0) for r in rounds), 4)
                                       for k in sorted({k for r in rounds for k in r["phases"]})} if rounds else {}})
    return row


def main() -> None:
    import torch

    device = "cuda" if torch.cuda.is_available() and os.environ.get("BENCH_DEVICE") != "cpu-proxy" else "cpu-proxy"
    rows = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        compute = None
        for H in HS:
            for name in ROWS:
                if name == "compute-only" and H != HS[0]:
                    continue
                row = run_mode(name, H, device, Path(tmp))
                if name == "compute-only":
                    compute = row if "error" not in row else None
                elif "error" not in row:
                    compare(row, compute, next((r for r in rows if r["mode"] == "sync fp32" and r["H"] == H
                                                and "error" not in r), None))
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
                if ROWS_FILE:
                    with open(ROWS_FILE, "a") as f:
                        f.write(json.dumps(row) + "\n")
    print(json.dumps({"rows": rows, "targets": targets(rows)}, indent=1))


def compare(row: dict, compute: dict | None, sync: dict | None) -> None:
    """A DiLoCo row against the same run's compute-only row (speed, host memory) and "sync fp32" row (loss)."""
    if compute is not None:
        row["compute_only_tokens_per_s"] = compute["tokens_per_s"]
        row["share_of_compute_only"] = round(row["tokens_per_s"] / compute["tokens_per_s"], 3)
        model_gb = 4 * row["parameters"] / 1e9
        added = row["host_train_gb"] - compute["host_train_gb"]
        row["host_added_gb"] = round(added, 3)
        row["host_added_x_model"] = round(added / model_gb, 2)
        row["host_join_x_model"] = round(row["host_join_gb"] / model_gb, 2)
    phases = row["phases_s_per_round"]
    if phases.get("compute"):
        row["exchange_vs_compute"] = round(sum(v for k, v in phases.items() if k != "compute") / phases["compute"], 3)
    if sync is not None and sync.get("eval_loss") and row.get("eval_loss"):
        row["eval_loss_vs_sync_fp32"] = round(row["eval_loss"] / sync["eval_loss"] - 1, 4)


def targets(rows: list[dict]) -> dict:
    """Each row against the issue's targets: met (true), missed (false), or not its target (absent).
    (Issue "Billion-parameter rounds": the 1B rows' exchange and host memory, the 86M rows' loss.)"""
    met = {}
    for r in (r for r in rows if "error" not in r and r["mode"] != "compute-only"):
        name = f"{r['mode']} H={r['H']} P={r['parameters'] / 1e6:.0f}M"
        mine = met[name] = {"host_added_x_model <= 2.5": (r.get("host_added_x_model") or 99) <= 2.5}
        if r["mode"].startswith("overlap"):
            mine.update({"blocked_share <= 0.05": r["blocked_share"] <= 0.05,
                         "step_inflation <= 0.03": r["step_inflation"] is not None and r["step_inflation"] <= 0.03,
                         "share_of_compute_only >= 0.95": (r.get("share_of_compute_only") or 0) >= 0.95,
                         "exchange_vs_compute <= 0.5": (r.get("exchange_vs_compute") or 99) <= 0.5})
            if r.get("eval_loss_vs_sync_fp32") is not None:
                mine["eval_loss_vs_sync_fp32 <= 0.005"] = r["eval_loss_vs_sync_fp32"] <= 0.005
        elif r["mode"].startswith("sync fp32"):
            mine["blocked_vs_raw <= 1.0"] = (r["blocked_vs_raw"] or 99) <= 1.0
    return met


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        print(json.dumps(worker(json.loads(sys.argv[2]))), flush=True)
    else:
        main()
