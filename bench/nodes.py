"""Islands of several nodes: a round's exchange with replicas of K = 1, 2, 4 nodes, and what a lost
node costs (issue "Islands of several nodes").

Two replicas of `_nodes_job` (a model of S MB whose inner steps cost little) train through
`diloco run` on the local backend, each a replica of K nodes of one process (`nodes = K`: K
torchrun agents on loopback, `diloco.local.island`). Every process's link to the store is
throttled to `BENCH_RATE` bytes/s each way (`diloco.store.throttle`), so with one process per
node each node has the same link, as each machine of a real island has its own network card.
Every process exchanges its lane (1/K of the model), so the replica's round moves over K links.

Exchange rows (per K, same run settings, same model):
- exchange_s: the median over rounds 2.. of the round's slowest `sync_s` (the time the training
  loop waits for the round: upload, reduce, gather, outer step), and its ratio to K = 1
  (target at K = 4: ≤ 0.35×, i.e. ≥ 0.7 of linear);
- wire_s: the bytes one node moves in a round at the link's rate (its lanes' up, then down);
- bytes per node per round (up / down), from the replicas' own counts;
- host memory: the peak RSS of each process (= each node here) and its ratio to the model.

Every "node" here shares this machine's 2 cores, where a real node brings its own: a round's CPU
work (deltas, encoding and CRC-32, reducing, the outer step, the digest) is a floor no K lowers
here. The default rows slow the links until the wire dominates, as it does for a 1B model on
real links (4 GB over ~100-300 MB/s is 13-40 s a round); `BENCH_RATE=25e6` shows the floor.

Lost-node rows (K = 1 and K = 2): after round KILL_AFTER, replica 1 loses a node (K = 1: its one
process group SIGKILLed; K = 2: node 1's torchrun agent SIGKILLed, so node 0 is stopped by the
island); recovery_s is the SIGKILL to its first round back as a member, relaunched as one attempt.

    .venv/bin/python bench/nodes.py                 # S = 50 MB, 5 MB/s a node (~15 min on 2 cores)
    BENCH_MB=100 BENCH_RATE=25e6 .venv/bin/python bench/nodes.py   # faster links: the shared cores show
    BENCH_MB=100 BENCH_NODES=1,2 .venv/bin/python bench/nodes.py
    BENCH_QUICK=1 .venv/bin/python bench/nodes.py   # a smoke run
Prints one JSON object: {"exchange": [...], "lost_node": [...]}.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import QUICK, knob, toml_text  # noqa: E402 - bench/ is the script's directory

MB = float(knob("BENCH_MB", "50", "8"))
RATE = float(knob("BENCH_RATE", "5e6", "50e6"))  # bytes/s each way, per process (= per node)
NODES = [int(x) for x in knob("BENCH_NODES", "1,2,4", "1,2").split(",")]
H = int(knob("BENCH_H", "2", "2"))
STEP_S = float(knob("BENCH_STEP_S", "0.1", "0.05"))
ROUNDS = int(knob("BENCH_ROUNDS", "6", "3"))
KILL_ROUNDS, KILL_AFTER = int(knob("BENCH_KILL_ROUNDS", "12", "6")), 3
# parts of at most this many MiB: a round is N·P parts owned in turn, and every lane reduces only
# when each replica owns a part in every lane (P >= the lanes; at 1B parameters 32 MiB parts give
# P in the tens): 8 MiB gives P = 7 at 100 MB and N = 2
PART_MB = float(knob("BENCH_PART_MB", "8", "1"))
LOST = [int(x) for x in knob("BENCH_LOST", "1,2", "" if QUICK else "1,2").split(",") if x]
BENCH = Path(__file__).resolve().parent


def spec(tmp: Path, name: str, nodes: int, rounds: int, out: Path, *, checkpoint_every: int) -> Path:
    data = {"name": name, "backend": "local", "replicas": 2, "nodes": nodes, "processes_per_replica": 1,
            "entrypoint": "_nodes_job:train", "workdir": str(BENCH),
            "args": {"megabytes": MB, "steps": H * rounds, "step_s": STEP_S, "out_dir": str(out)},
            "diloco": {"sync_every": H, "total_steps": H * rounds, "checkpoint_every": checkpoint_every,
                       "round_timeout": 600,
                       "part_mb": PART_MB,
                       "parameters": int(MB * 2**20) // 4},
            "restart": {"backoff": 0.0, "monitor_interval": 0.2},
            "env": {"DILOCO_STORE_BYTES_PER_S": f"{RATE:g}"}}
    path = tmp / f"{name}.toml"
    path.write_text(toml_text(data))
    return path


def metrics(uri: str, run_id: str) -> list[dict]:
    from diloco.store.objectstore import open_store
    from diloco.store.runkeys import RunKeys

    store = open_store(uri)
    rows = [store.get(m["path"]) for m in store.list(RunKeys(run_id).metrics())]
    return [json.loads(bytes(r)) for r in rows if r is not None]


def agent_of(run_id: str, rank: int, node: int) -> int | None:
    """The torchrun agent of `node` of replica `rank` (by its environment), if it runs."""
    want = {f"DILOCO_RUN_ID={run_id}".encode(), f"REPLICA_RANK={rank}".encode(), f"PET_NODE_RANK={node}".encode()}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and b"diloco_replica.torchrun" in (entry / "cmdline").read_bytes():
                if want <= set((entry / "environ").read_bytes().split(b"\0")):
                    return int(entry.name)
        except OSError:
            continue
    return None


def launch(tmp: Path, name: str, nodes: int, rounds: int, *, checkpoint_every: int) -> tuple[subprocess.Popen, str, Path, Path]:
    out, state = tmp / f"{name}-out", tmp / f"{name}-state"
    out.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "diloco", "run",
                             str(spec(tmp, name, nodes, rounds, out, checkpoint_every=checkpoint_every)),
                             "--on-interrupt", "cancel"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "DILOCO_STATE_DIR": str(state)})
    return proc, proc.stdout.readline().split()[1].rstrip(":"), state, out


def finish(proc: subprocess.Popen, what: str) -> None:
    text, _ = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"diloco run ({what}) failed:\n{text[-4000:]}")


def exchange_row(tmp: Path, nodes: int) -> dict:
    from diloco.runrecord.state import RunRecord

    # no checkpoint in the rounds measured (one at the end): a checkpoint's bytes share the links
    proc, run_id, state, out = launch(tmp, f"nodes-{nodes}", nodes, ROUNDS, checkpoint_every=ROUNDS)
    finish(proc, f"{nodes} nodes")
    rows = metrics(RunRecord.load(run_id, state).rendezvous, run_id)
    by_round: dict[int, list[dict]] = {}
    for r in rows:
        by_round.setdefault(r["round"], []).append(r)
    syncs = [max(x["sync_s"] for x in rs) for rnd, rs in sorted(by_round.items()) if rnd >= 2]
    later = [x for rnd, rs in by_round.items() if rnd >= 2 for x in rs]
    up = statistics.median(x["bytes_up"] for x in later) / nodes
    down = statistics.median(x["bytes_down"] for x in later) / nodes
    procs = [json.loads(p.read_text()) for p in out.glob("*.json")]
    rss = [p["peak_rss_mb"] for p in procs]
    return {"nodes": nodes, "processes_per_node": 1, "model_mb": MB, "rate_mb_s_per_node": RATE / 1e6,
            "exchange_s": round(statistics.median(syncs), 3), "wire_s": round((up + down) / RATE, 3),
            "bytes_up_per_node_mb": round(up / 1e6, 1), "bytes_down_per_node_mb": round(down / 1e6, 1),
            "one_global_model": len({p["theta_digest"] for p in procs}) == 1 and len(procs) == 2 * nodes,
            "peak_rss_mb_per_process": round(max(rss)), "host_memory_vs_model": round(max(rss) / MB, 2)}


def lost_row(tmp: Path, nodes: int) -> dict:
    from diloco.runrecord.state import RunRecord
    from diloco.store.objectstore import open_store
    from diloco.store.runkeys import RunKeys

    proc, run_id, state, out = launch(tmp, f"lost-{nodes}", nodes, KILL_ROUNDS, checkpoint_every=1)
    run_dir = state / "runs" / run_id
    while proc.poll() is None and not (run_dir / "run.json").exists():
        time.sleep(0.1)
    store = open_store(RunRecord.load(run_id, state).rendezvous)
    while proc.poll() is None and store.get(RunKeys(run_id).metrics(KILL_AFTER, 1)) is None:
        time.sleep(0.05)
    if nodes == 1:
        handle = json.loads((run_dir / "run.json").read_text())["ranks"][1]["handle"]
        os.killpg(handle["metadata"]["pid"], signal.SIGKILL)
    else:
        os.kill(agent_of(run_id, 1, 1), signal.SIGKILL)
    killed = time.time()
    finish(proc, f"lost node, {nodes} nodes")
    record = RunRecord.load(run_id, state)
    rows = metrics(record.rendezvous, run_id)
    back = min(r["t"] for r in rows if r["rank"] == 1 and r.get("attempt", 0) >= 1 and r.get("member"))
    relaunches = [e for e in record.events() if e.get("event") == "relaunch_scheduled"]
    procs = [json.loads(p.read_text()) for p in out.glob("*.json")]
    return {"nodes": nodes, "model_mb": MB, "rate_mb_s_per_node": RATE / 1e6, "recovery_s": round(back - killed, 2),
            "global_state_read_s": round(2 * MB * 2**20 / nodes / RATE, 2), "relaunches": len(relaunches),
            "one_global_model": len({p["theta_digest"] for p in procs}) == 1,
            "peak_rss_mb_per_process": round(max(p["peak_rss_mb"] for p in procs))}


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="diloco-nodes-") as tmp:
        rows = [exchange_row(Path(tmp), k) for k in NODES]
        base = rows[0]["exchange_s"]
        for r in rows:
            r["vs_1_node"] = round(r["exchange_s"] / base, 3)
        lost = [lost_row(Path(tmp), k) for k in LOST]
    widest = rows[-1]
    targets = {"exchange_vs_1_node": {"nodes": widest["nodes"], "measured": widest["vs_1_node"],
                                      "target": 0.35 if widest["nodes"] == 4 else None,
                                      "met": widest["vs_1_node"] <= 0.35 if widest["nodes"] == 4 else None}}
    print(json.dumps({"no_gpu": True, "cores": os.cpu_count(), "exchange": rows, "lost_node": lost,
                      "targets": targets}, indent=1))


if __name__ == "__main__":
    main()
