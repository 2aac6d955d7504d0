"""Uneven GPUs: fixed-H rounds against time-based rounds (`[diloco] round_seconds`), N = 4; and
replicas of different process counts in one run (a 2-process replica beside 1-process ones).

Two of the four replicas take twice as long per inner step (tiny_lm's `slow_ranks`: a sleep as
long as the step, a stand-in for a GPU half as fast). With fixed H every round waits for them:
the fast replicas spend about half of each round waiting. With `round_seconds` every replica
trains until the round's deadline — the fast ones H steps, the slow ones about H/2 — and the
mean normalises each update by its steps (FedNova's average), so nobody waits.

Both rows run through `diloco run` on the main job. The fixed-H row runs first; the time-based
row's `round_seconds` is the fast replicas' compute time per round in it, and its length is
chosen so that both runs take the same wall-clock time (its rounds are shorter, so it has more).
The resize row starts 2 replicas, asks `diloco scale` for 4 a quarter of the way in and for 2
again at three quarters, as a user moving capacity between clouds would: how long a new replica
takes from the request to its first round, how many rounds ran at each size, and the loss.

The mixed rows run N = 3 at equal steps: three replicas of one process, then one replica of two
processes (DDP inside it, each process half the batch) beside two of one. Every replica syncs
the same model whatever its process count (diloco_replica's `layout`), so the question is what
the mixed replica pays: its bytes per round against a one-process replica's (bounded by one
part per process boundary), and the run's eval loss against the uniform run's.

Reported per row: replica-seconds spent waiting for a straggler (each round summary's
`waited_s`, summed) and its share of all replica time, tokens processed, tokens per second,
eval loss, wall time. Targets (issue "One run, many clouds"): waiting ≤ 2% of replica time with
round_seconds; eval loss at equal wall-clock no worse than fixed H.

    .venv/bin/python bench/uneven.py                  # ~6 minutes on 2 CPU cores; prints JSON
    BENCH_PLOTS=docs .venv/bin/python bench/uneven.py # also keep each row's timeline.png there
    BENCH_QUICK=1 .venv/bin/python bench/uneven.py    # a smoke run: every row at N = 2, two rounds each
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
from pathlib import Path

from _common import QUICK, knob, run_spec, tiny_lm_spec, toml_text  # noqa: E402 - bench/ is the script's directory

STEPS = int(knob("BENCH_STEPS", "500", "40"))
H = int(knob("BENCH_H", "50", "20"))
REPLICAS = 2 if QUICK else 4  # the smoke run: one fast replica and one slow, every row of half its size
SLOW = [1] if QUICK else [2, 3]
SINGLES = REPLICAS // 2  # the mixed rows' one-process replicas beside the two-process one


MIXED_GROUPS = """
[[group]]
name = "node"
replicas = 1
processes_per_replica = 2
[group.backend]
name = "local"
[[group]]
name = "singles"
replicas = {singles}
processes_per_replica = 1
[group.backend]
name = "local"
"""


def run_resized(spec: Path, state: Path, label: str, resize: list[tuple[int, int]]) -> tuple[Path, float, list]:
    """`run_spec`, asking `diloco scale` for resize[i][1] replicas once round resize[i][0] is done;
    also when each request was made and when the first round of the new size came."""
    env = {**os.environ, "DILOCO_STATE_DIR": str(state)}
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "diloco", "run", str(spec), "--on-interrupt", "cancel"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    run_id = proc.stdout.readline().split()[1].rstrip(":")
    events_path, log, todo = state / "runs" / run_id / "events.jsonl", [], list(resize)
    while proc.poll() is None and (todo or (log and log[-1].get("reached_round") is None)):
        rounds = [json.loads(x) for x in events_path.read_text().splitlines() if '"round"' in x] \
            if events_path.exists() else []
        rounds = [e for e in rounds if e.get("event") == "round"]
        if todo and rounds and rounds[-1]["round"] >= todo[0][0]:
            at, n = todo.pop(0)
            subprocess.run([sys.executable, "-m", "diloco", "scale", run_id, str(n)], env=env, check=True,
                           capture_output=True)
            log.append({"replicas": n, "asked_after_round": rounds[-1]["round"], "asked_t": time.time(),
                        "reached_round": None})
        if log and log[-1]["reached_round"] is None:
            reached = [e for e in rounds if e["round"] > log[-1]["asked_after_round"]
                       and len(e["members"]) == log[-1]["replicas"]]
            if reached:  # the first round of the new size, and the seconds from the request to its end
                log[-1].update(reached_round=reached[0]["round"], seconds=round(reached[0]["t"] - log[-1]["asked_t"], 1))
        time.sleep(0.2)
    out, _ = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"diloco run ({label}) failed:\n{out[-4000:]}")
    for entry in log:
        entry.pop("asked_t")
    return state / "runs" / run_id, time.monotonic() - t0, log


def run_row(name: str, diloco: dict, tmp: Path, *, slow: list[int] = SLOW, replicas: int = REPLICAS,
            groups: str | None = None, resize: list[tuple[int, int]] | None = None) -> dict:
    spec = tmp / f"{name}.toml"
    state = tmp / f"state-{name}"
    data = tiny_lm_spec(args={"slow_ranks": slow, "eval_every": 0, "parallel": "ddp"},
                        diloco={"sync_every": H, **diloco})
    if groups is None:
        data["replicas"] = replicas
    else:
        del data["replicas"], data["backend"]
    spec.write_text(toml_text(data) + (groups or ""))
    tokens_per_step = data["args"]["batch_size"] * data["args"]["context"]
    if resize:
        run_dir, wall, resized = run_resized(spec, state, name, resize)
    else:
        (run_dir, wall), resized = run_spec(spec, state, name), None
    from diloco.store.metrics import RoundCache

    rounds = RoundCache(run_dir).load()
    plots = os.environ.get("BENCH_PLOTS")
    if plots and name != "probe" and (run_dir / "artifacts" / "timeline.png").exists():
        shutil.copy(run_dir / "artifacts" / "timeline.png", Path(plots) / f"uneven-{name}-timeline.png")
    summary = json.loads((run_dir / "artifacts" / "summary.json").read_text())
    recorded = json.loads((run_dir / "run.json").read_text())["ranks"]
    results = [r["result"] for r in recorded if r.get("result")]
    # the replicas that trained to the end hold one global model (a retired one, the round it left after)
    if len({r["result"]["theta_digest"] for r in recorded if r.get("result") and not r.get("retired")}) != 1:
        raise SystemExit(f"{name}: replicas disagree on θ_global")
    replica_s = sum(r["wall_s"] for r in results)
    waited = sum(s.waited_s for s in rounds)
    fast_compute = [row.compute_s for s in rounds[1:] for row in s.rows if row.rank not in slow]
    ranks = sorted({row.rank for s in rounds[1:] for row in s.rows})
    steps_per_round = {rank: statistics.median(row.tokens for s in rounds[1:] for row in s.rows if row.rank == rank)
                       // tokens_per_step for rank in ranks}
    later = [row for s in rounds[1:] for row in s.rows]  # past the first round (it checks more, deletes nothing)
    traffic = {rank: {"bytes_up": round(statistics.median(r.bytes_up for r in later if r.rank == rank)),
                      "bytes_down": round(statistics.median(r.bytes_down for r in later if r.rank == rank))}
               for rank in ranks} if later else {}
    return {
        "row": name, "diloco": diloco, "rounds": len(rounds), "wall_s": round(wall, 1),
        "train_s": round(max(r["wall_s"] for r in results), 1), "replica_s": round(replica_s, 1),
        "waiting_replica_s": round(waited, 2), "waiting_share": round(waited / replica_s, 4),
        "waited_s_by_round": [round(s.waited_s, 2) for s in rounds],
        "tokens": summary["tokens"], "tokens_per_s": round(summary["tokens"] / max(r["wall_s"] for r in results)),
        "eval_loss": round(summary["eval_loss"], 4), "inner_steps_per_round_by_rank": steps_per_round,
        "fast_compute_s_per_round": round(statistics.median(fast_compute), 3) if fast_compute else None,
        "sync_s_per_round": round(statistics.median(row.sync_s for s in rounds[1:] for row in s.rows), 3)
        if len(rounds) > 1 else None,
        "traffic_per_round_by_rank": traffic,
        **({"resize": resized, "members_by_round": [len(s.members) for s in rounds]} if resize else {}),
    }


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        fixed = run_row("fixed-H", {"total_steps": STEPS}, Path(tmp))
        # a time-based round lasts what a fast replica's H steps took; as many rounds as fit in
        # the fixed-H run's training time, so both rows train for the same wall-clock time. What
        # a time-based round costs in all (its sync, start-up) is measured by a short run first.
        # (In quick mode the probe is skipped: as many rounds as the fixed-H row had, a smoke run.)
        seconds = round(max(0.05, fixed["fast_compute_s_per_round"] or 1.0), 3)
        if QUICK:
            rounds = fixed["rounds"]
        else:
            probe = run_row("probe", {"round_seconds": seconds, "total_steps": 4 * H}, Path(tmp))
            rounds = max(2, round(fixed["train_s"] / (probe["train_s"] / probe["rounds"])))
        timed = run_row("round_seconds", {"round_seconds": seconds, "total_steps": rounds * H}, Path(tmp))
        uniform = run_row(f"uniform-{SINGLES + 1}x1", {"total_steps": STEPS}, Path(tmp), slow=[], replicas=SINGLES + 1)
        mixed = run_row("mixed-2" + "+1" * SINGLES, {"total_steps": STEPS}, Path(tmp), slow=[], replicas=SINGLES + 1,
                        groups=MIXED_GROUPS.format(singles=SINGLES))
        rounds_in = STEPS // H
        # (not in quick mode: its few short rounds end before a new replica has started, so the
        # row would prove nothing; tests/test_elastic.py resizes runs end to end)
        resized = None if QUICK else run_row("resize-2-4-2", {"total_steps": STEPS}, Path(tmp), slow=[], replicas=2,
                                             resize=[(max(1, rounds_in // 4), 4), (max(2, 3 * rounds_in // 4), 2)])
        pair = None if QUICK else run_row("uniform-2x1", {"total_steps": STEPS}, Path(tmp), slow=[], replicas=2)
    two, one = mixed["traffic_per_round_by_rank"].get(0), mixed["traffic_per_round_by_rank"].get(1)
    print(json.dumps({
        "bench": "uneven", "replicas": REPLICAS, "slow_ranks": SLOW, "slowdown": 2, "sync_every": H,
        "rows": [fixed, timed],
        "round_seconds_vs_fixed": {"waiting_share": [fixed["waiting_share"], timed["waiting_share"]],
                                   "train_s": round(timed["train_s"] / fixed["train_s"], 3),
                                   "tokens": round(timed["tokens"] / fixed["tokens"], 3),
                                   "eval_loss": round(timed["eval_loss"] / fixed["eval_loss"] - 1, 4)},
        "mixed_rows": [uniform, mixed],
        "resize_rows": [pair, resized] if resized else [],
        "resize_vs_two": {"tokens": round(resized["tokens"] / pair["tokens"], 3),
                          "eval_loss": round(resized["eval_loss"] / pair["eval_loss"] - 1, 4),
                          "waiting_share": [pair["waiting_share"], resized["waiting_share"]]} if resized else None,
        "mixed_vs_uniform": {
            "eval_loss": round(mixed["eval_loss"] / uniform["eval_loss"] - 1, 4),
            "waiting_share": [uniform["waiting_share"], mixed["waiting_share"]],
            "two_process_replica_bytes_vs_one": {k: round(two[k] / one[k], 3) for k in two} if two and one else None},
        "targets": {"round_seconds waiting_share": "<= 0.02", "round_seconds eval_loss vs fixed H": "<= 0 at equal "
                    "wall-clock", "mixed eval_loss vs uniform": "within noise (the same model, batch and steps)"},
    }, indent=2))


if __name__ == "__main__":
    main()
