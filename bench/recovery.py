"""Recovery time as the model grows: the seconds from a replica's SIGKILL to its first round back
as a member, against what it must read to come back (issue "A thousand faults").

Two replicas of `_recovery_job` (a model of the row's size whose inner steps cost little) train
through `diloco run` on the local backend; each replica's store is a file:// store behind a
link of `BENCH_RATE` bytes/s each way (`diloco.store.throttle`, the benches' stand-in for a
replica's network), with a checkpoint every round; an inner step sleeps `BENCH_STEP_S` for its
compute, so a round has a period (H steps) like a real one. Once round `KILL_AFTER` is done, rank 1's
process is SIGKILLed; the launcher relaunches it at once ([restart] backoff 0); it starts,
loads θ_global and the outer momentum from the latest checkpoint, and takes part again from a
round boundary. Measured per row, all from the same run:

- recovery_s: SIGKILL → the end of rank 1's first round as a member again (its metrics row),
  and its parts: start_s (SIGKILL → the new process has built its model: noticing the exit,
  relaunching, Python, torch, the model), load_s (→ it holds the global state: reading θ_global
  and the momentum from the checkpoint, and any rounds after it) and to_round_boundary_s (→ the
  end of the first round it trains with the others: a rejoin starts at a round boundary);
- transfer_s: what rejoining must read (θ_global and the momentum: 2 × the model) at the link's
  rate, and load_vs_transfer = load_s / transfer_s;
- recovery_vs_target: recovery_s / (1.2 × transfer_s + start_s). Target: ≤ 1;
- round_s: the median round period of the survivor;
- peak RSS of each replica (host memory), from the replicas' own results.

    .venv/bin/python bench/recovery.py                 # 100 MB and 1 GB (~10 minutes on 2 cores)
    BENCH_SIZES_MB=100,1024,4096 .venv/bin/python bench/recovery.py   # 4 GB needs ~40 GB of RAM
    BENCH_QUICK=1 .venv/bin/python bench/recovery.py   # 8 MB: a smoke run
Prints one JSON object: {"rows": [...]}.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import knob, toml_text  # noqa: E402 - bench/ is the script's directory

SIZES_MB = [float(x) for x in knob("BENCH_SIZES_MB", "100,1024", "8").split(",")]
RATE = float(knob("BENCH_RATE", "200e6", "200e6"))  # bytes/s each way, per replica process
H = int(knob("BENCH_H", "4", "4"))
STEP_S = float(knob("BENCH_STEP_S", "0.5", "0.25"))  # an inner step's compute, slept (a round: H of them)
ROUNDS = int(knob("BENCH_ROUNDS", "20", "16"))
KILL_AFTER = int(knob("BENCH_KILL_AFTER", "3", "2"))
BENCH = Path(__file__).resolve().parent


def spec(tmp: Path, megabytes: float) -> Path:
    data = {"name": "recovery", "backend": "local", "replicas": 2, "entrypoint": "_recovery_job:train",
            "workdir": str(BENCH), "args": {"megabytes": megabytes, "steps": H * ROUNDS, "step_s": STEP_S},
            "diloco": {"sync_every": H, "total_steps": H * ROUNDS, "checkpoint_every": 1, "round_timeout": 600,
                       "parameters": int(megabytes * 2**20) // 4},
            "restart": {"backoff": 0.0, "monitor_interval": 0.2},
            "env": {"DILOCO_STORE_BYTES_PER_S": f"{RATE:g}"}}
    path = tmp / f"recovery-{megabytes:g}.toml"
    path.write_text(toml_text(data))
    return path


def rows_of(store_uri: str, run_id: str) -> list[dict]:
    from diloco.store.runkeys import RunKeys
    from diloco.store.objectstore import open_store

    store, out = open_store(store_uri), []
    for meta in store.list(RunKeys(run_id).metrics()):
        raw = store.get(meta["path"])
        if raw is not None:
            out.append(json.loads(bytes(raw)))
    return out


def logged_at(log: Path, text: str) -> float | None:
    """The wall time of the replica's first line containing `text` (logging's asctime, local time)."""
    for line in log.read_text(errors="replace").splitlines():
        m = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ", line)
        if m and text in line:
            return time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000
    return None


def row(megabytes: float, tmp: Path) -> dict:
    from diloco.store.runkeys import RunKeys
    from diloco.runrecord.state import RunRecord
    from diloco.store.objectstore import open_store

    state = tmp / f"state-{megabytes:g}"
    env = {**os.environ, "DILOCO_STATE_DIR": str(state)}
    proc = subprocess.Popen([sys.executable, "-m", "diloco", "run", str(spec(tmp, megabytes)), "--on-interrupt",
                             "cancel"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    run_id = proc.stdout.readline().split()[1].rstrip(":")
    run_dir = state / "runs" / run_id
    while proc.poll() is None and not (run_dir / "run.json").exists():
        time.sleep(0.1)
    uri = RunRecord.load(run_id, state).rendezvous
    store = open_store(uri)
    while proc.poll() is None and store.get(RunKeys(run_id).metrics(KILL_AFTER, 1)) is None:
        time.sleep(0.05)
    handle = json.loads((run_dir / "run.json").read_text())["ranks"][1].get("handle") or {}
    os.killpg(handle["metadata"]["pid"], signal.SIGKILL)
    killed = time.time()
    out, _ = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"diloco run ({megabytes:g} MB) failed:\n{out[-4000:]}")
    record = RunRecord.load(run_id, state)
    rows = rows_of(uri, run_id)
    back = min(r["t"] for r in rows if r["rank"] == 1 and r.get("attempt", 0) >= 1 and r.get("member"))
    launch = next(e["t"] for e in record.events() if e.get("event") == "launch" and e.get("attempt") == 1)
    log = Path(record.data["ranks"][1]["handle"]["metadata"]["stem"] + ".log")  # attempt 1's
    built, joined = logged_at(log, "built"), logged_at(log, "joined: ")
    ends = sorted(r["t"] for r in rows if r["rank"] == 0)
    results = [r["result"] for r in record.data["ranks"]]
    transfer = 2 * megabytes * 2**20 / RATE
    start, load, recovery = built - killed, joined - built, back - killed
    return {"model_mb": megabytes, "rate_mb_s": RATE / 1e6, "recovery_s": round(recovery, 2),
            "start_s": round(start, 2), "load_s": round(load, 2), "to_round_boundary_s": round(back - joined, 2),
            "transfer_s": round(transfer, 2), "load_vs_transfer": round(load / transfer, 2),
            "recovery_vs_target": round(recovery / (1.2 * transfer + start), 2),
            "relaunch_s": round(launch - killed, 2),
            "round_s": round(statistics.median([b - a for a, b in zip(ends, ends[1:])]), 2),
            "one_global_model": len({r["theta_digest"] for r in results}) == 1,
            "peak_rss_mb": [round(r.get("peak_rss_mb") or 0) for r in results]}


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="diloco-recovery-") as tmp:
        rows = [row(mb, Path(tmp)) for mb in SIZES_MB]
    print(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
