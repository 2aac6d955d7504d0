"""diloco against torchft's DiLoCo: the same tiny LM, N = 2 and 4, on CPU with gloo.

Both sides train examples/tiny-lm's model on its data with the same spec: the same H, inner AdamW
and learning-rate schedule, outer SGD-Nesterov (lr and momentum from the spec), seeds and steps.
diloco runs it as a user does (`diloco run`, local backend, file:// store); torchft 0.2.0 runs
it in a venv of its own (`_torchft_side.py`: a lighthouse, a Manager per replica on a gloo
process group, `DiLoCo(...)` around the loop; `_torchft_worker.py` imports tiny_lm's functions).

Per N and side, a clean run gives the median inner step, what a round costs the training loop
beyond its inner steps (diloco: each row's `sync_s`; torchft: the time spent in DiLoCo's
post-step hook on the inner optimizer, where its sync runs), over the rounds after the first, as two medians over rounds: of
the replicas' mean (`sync_s_per_round`: waiting for the slowest included) and of their minimum
(`sync_s_exchange`: the last to arrive waits for nobody, so that is the exchange and the outer
step themselves), each also in the run's own inner steps (the machine is shared: when its load
moves between runs, both move alike), and the global model's eval loss at the same step count. A second run SIGKILLs the last replica half a round after it
finished round `BENCH_KILL_ROUND` and measures the seconds until it is back in a round (its first
round applied as a member): diloco's supervisor relaunches it (the spec's [restart] policy, its
default 1 s backoff) and it rejoins from the store; torchft leaves relaunching to the user's
scheduler, so the bench restarts it the moment it is reaped, and it heals from a peer.

    .venv/bin/python bench/peers.py                  # ~10 min on 2 CPU cores; prints JSON
    BENCH_QUICK=1 .venv/bin/python bench/peers.py    # a smoke run: N = 2, a few rounds, no kill

The first run makes the torchft venv (~40 s; `BENCH_TORCHFT_VENV` says where, reused after).
BENCH_REPLICAS, BENCH_STEPS, BENCH_H, BENCH_KILL (1/0) and BENCH_KILL_ROUND scale it. Targets
(issue 32): against torchft at N = 2 and 4, sync cost per round <= torchft's, and rejoin after a
kill no slower.
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
from collections.abc import Callable
from pathlib import Path

from _common import knob, tiny_lm_spec, toml_text  # noqa: E402 - bench/ is the script's directory

import _torchft_side as torchft  # noqa: E402

REPLICAS = [int(n) for n in knob("BENCH_REPLICAS", "2,4", "2").split(",")]
STEPS = int(knob("BENCH_STEPS", "300", "60"))
H = int(knob("BENCH_H", "25", "10"))
KILL = knob("BENCH_KILL", "1", "0") == "1"
KILL_ROUND = int(knob("BENCH_KILL_ROUND", "3", "1"))


def spec_text(replicas: int) -> str:
    """The main job at N = `replicas`, this bench's length and H; no periodic evals (rank 0's
    evals would be diloco-only work in the loop)."""
    spec = tiny_lm_spec(args={"eval_every": 0}, diloco={"total_steps": STEPS, "sync_every": H})
    spec["replicas"] = replicas
    return toml_text(spec)


def run_diloco(spec: Path, replicas: int, tmp: Path, kill_after_round: int | None = None,
               kill_delay: Callable[[], float] = lambda: 0.0) -> dict:
    """One `diloco run` of `spec`; with `kill_after_round`, the last replica is SIGKILLed
    `kill_delay()` seconds after its row of that round is in the store."""
    from diloco.store.metrics import RoundCache
    from diloco.store.runkeys import RunKeys

    state, log = tmp / "state", tmp / "diloco-run.log"
    tmp.mkdir(parents=True)
    with log.open("w") as out:  # the child holds its own copy of the descriptor
        proc = subprocess.Popen([sys.executable, "-m", "diloco", "run", str(spec), "--on-interrupt", "cancel"],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "DILOCO_STATE_DIR": str(state)})
    try:
        run_id = wait_until(lambda: first_line(log), proc, log).split()[1].rstrip(":")
        run_dir, victim, killed_at = state / "runs" / run_id, replicas - 1, None
        if kill_after_round is not None:
            row = run_dir / "store" / RunKeys(run_id).metrics(kill_after_round, victim)
            wait_until(row.exists, proc, log)
            time.sleep(kill_delay())
            record = json.loads((run_dir / "run.json").read_text())
            killed_at = time.time()
            os.kill(record["ranks"][victim]["handle"]["metadata"]["pid"], signal.SIGKILL)
        if proc.wait(timeout=1800) != 0:
            raise SystemExit(f"diloco run failed:\n{log.read_text()[-4000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
    rounds = RoundCache(run_dir).load()
    results = [r["result"] for r in json.loads((run_dir / "run.json").read_text())["ranks"]]
    if len({r["theta_digest"] for r in results}) != 1:
        raise SystemExit("diloco replicas disagree on the global model")
    rows = [row for s in rounds for row in s.rows if row.member]
    result = {
        "system": "diloco", "replicas": replicas,
        "inner_step_s": statistics.median(row.compute_s / H for row in rows if row.compute_s),
        "sync_s_by_round": {s.round: [row.sync_s for row in s.rows if row.member] for s in rounds},
        "eval_loss": json.loads((run_dir / "artifacts" / "summary.json").read_text())["eval_loss"],
        "train_s": max(r["wall_s"] for r in results),
    }
    if killed_at is not None:
        events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]
        back = next(row.t for s in rounds for row in s.rows if row.rank == victim and row.attempt > 0 and row.member)
        relaunch = next(e["t"] for e in events if e["event"] == "launch" and e.get("attempt", 0) > 0)
        result.update(rejoin_s=round(back - killed_at, 2), relaunched_s=round(relaunch - killed_at, 2),
                      survivor_rounds_without_it=sum(1 for s in rounds if victim not in s.members))
    return result


def first_line(log: Path) -> str | None:
    lines = log.read_text().splitlines() if log.exists() else []
    return lines[0] if lines and lines[0].startswith("run ") else None


def wait_until(ready: Callable[[], object], proc: subprocess.Popen, log: Path, timeout: float = 600) -> object:
    deadline = time.monotonic() + timeout
    while not (value := ready()):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"diloco run ended or stuck before the bench could act:\n{log.read_text()[-4000:]}")
        time.sleep(0.02)
    return value


def summary(raw: dict) -> dict:
    """One side's row: its median inner step and what a round costs its loop beyond the inner
    steps, over the rounds after the first (which pays one-time set-up on both sides), as the
    median over rounds of the replicas' mean (waiting for the others included) and of their
    minimum (the last to arrive waits for nobody: the exchange and the outer step themselves)."""
    rounds = [v for r, v in raw.pop("sync_s_by_round").items() if int(r) > 1 and v]
    row = {k: round(v, 4) if isinstance(v, float) else v for k, v in raw.items()}
    row["sync_s_per_round"] = round(statistics.median(statistics.fmean(v) for v in rounds), 4)
    row["sync_s_exchange"] = round(statistics.median(min(v) for v in rounds), 4)
    row["rounds_measured"] = len(rounds)
    # in the run's own inner steps: both scale alike when the shared machine's load moves
    row["sync_per_round_in_inner_steps"] = round(row["sync_s_per_round"] / row["inner_step_s"], 3)
    row["sync_exchange_in_inner_steps"] = round(row["sync_s_exchange"] / row["inner_step_s"], 3)
    return row


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def compare(d: dict, t: dict) -> dict:
    """diloco against torchft, measured in the same bench run (below 1: diloco is cheaper)."""
    out = {"replicas": d["replicas"], "inner_step": round(d["inner_step_s"] / t["inner_step_s"], 3),
           "sync_s_per_round": round(d["sync_s_per_round"] / t["sync_s_per_round"], 3),
           "sync_s_exchange": round(d["sync_s_exchange"] / t["sync_s_exchange"], 3),
           "sync_per_round_in_inner_steps": round(d["sync_per_round_in_inner_steps"]
                                                  / t["sync_per_round_in_inner_steps"], 3),
           "sync_exchange_in_inner_steps": round(d["sync_exchange_in_inner_steps"]
                                                 / t["sync_exchange_in_inner_steps"], 3),
           "train_s": round(d["train_s"] / t["train_s"], 3),
           "eval_loss": round(d["eval_loss"] / t["eval_loss"] - 1, 4)}
    if "kill_run" in d:
        out["rejoin_s"] = round(d["kill_run"]["rejoin_s"] / t["kill_run"]["rejoin_s"], 3)
    return out


def main() -> None:
    torchft.torchft_python()  # made (or found) before anything is timed
    rows, ratios, loads = [], [], [load()]
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        for n in REPLICAS:
            spec = tmp / f"n{n}.toml"
            spec.write_text(spec_text(n))
            d = summary(run_diloco(spec, n, tmp / f"diloco-{n}"))
            t = summary(torchft.run(spec, n, tmp / f"torchft-{n}"))
            if KILL:  # killed half a round in, by each side's own clean round length
                d["kill_run"] = summary(run_diloco(spec, n, tmp / f"diloco-{n}-kill", KILL_ROUND,
                                                   lambda: H * d["inner_step_s"] / 2))
                t["kill_run"] = summary(torchft.run(spec, n, tmp / f"torchft-{n}-kill", KILL_ROUND,
                                                    lambda: H * t["inner_step_s"] / 2))
            rows += [d, t]
            ratios.append(compare(d, t))
            loads.append(load())
    print(json.dumps({
        "bench": "peers", "torchft": torchft.PINS[0], "steps_per_replica": STEPS, "sync_every": H,
        "kill_after_round": KILL_ROUND if KILL else None, "loadavg_1_5_15": loads, "rows": rows,
        "diloco_vs_torchft": ratios,
        "targets": {"diloco_vs_torchft sync_s_per_round": "<= 1 at N = 2 and 4",
                    "diloco_vs_torchft rejoin_s": "<= 1 at N = 2 and 4"},
    }, indent=2))


if __name__ == "__main__":
    main()
