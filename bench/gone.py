"""Gone is not waited for: a run of 4 replicas with one gone for the middle third of it, against
3 replicas alone, in the same bench run (issue "Gone is not waited for").

The "alone" row trains the main job with 3 replicas. The "gone" row trains it with 4; once a
third of its rounds are done rank 3 is SIGKILLed, and its relaunch is held back (the restart
`backoff`) for a third of the alone row's training time: to the others it is a replica waiting
for capacity (pending), which the launcher knows is not running. Then it is relaunched, loads
the global state and takes part again from a round boundary.

Reported per row: tokens/s of ranks 0-2 (the replicas both rows share) over their whole
training (on shared CPU cores a fourth replica's compute slows the other three while it runs, a
cost GPUs do not share, so the target is read while rank 3 is gone), and the median round
period (seconds between successive rounds' ends, waiting included) overall and, for the gone
row, while rank 3 was gone; for the gone row also the seconds from rank 3's relaunch to the end
of its first round as a member again, the members of each round, and whether every replica
ended on one θ_global. Targets:
ranks 0-2's tokens/s while rank 3 is gone ≥ 0.95× the alone row's (their rounds carry equal
tokens, so it is the ratio of round periods: no round waits for the gone replica); host memory:
each row's peak RSS of one replica.

    .venv/bin/python bench/gone.py                  # ~3 minutes on 2 CPU cores; prints JSON
    BENCH_QUICK=1 .venv/bin/python bench/gone.py    # a smoke run
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

from _common import knob, tiny_lm_spec, toml_text  # noqa: E402 - bench/ is the script's directory

STEPS = int(knob("BENCH_STEPS", "600", "80"))
H = int(knob("BENCH_H", "20", "10"))
GONE = 3


def run(name: str, tmp: Path, replicas: int, *, kill_after_round: int | None = None, hold_s: float = 0.0) -> dict:
    """`diloco run` of the main job with `replicas`; with `kill_after_round`, rank GONE is killed once
    that round is done and relaunched `hold_s` later."""
    restart = {"backoff": hold_s, "backoff_max": max(hold_s, 1.0)} if kill_after_round else {}
    data = tiny_lm_spec(args={"eval_every": 0}, diloco={"sync_every": H, "total_steps": STEPS})
    data["replicas"] = replicas
    if restart:
        data["restart"] = restart
    spec, state = tmp / f"{name}.toml", tmp / f"state-{name}"
    spec.write_text(toml_text(data))
    env = {**os.environ, "DILOCO_STATE_DIR": str(state)}
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "diloco", "run", str(spec), "--on-interrupt", "cancel"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    run_id = proc.stdout.readline().split()[1].rstrip(":")
    run_dir = state / "runs" / run_id
    killed_at = None
    if kill_after_round is not None:
        from diloco.store.runkeys import RunKeys
        from diloco.runrecord.state import RunRecord
        from diloco.store.objectstore import open_store

        while proc.poll() is None and not (run_dir / "run.json").exists():
            time.sleep(0.1)
        store = open_store(RunRecord.load(run_id, state).rendezvous)
        # the round's end as the replicas write it (the launcher's round events come in batches)
        while proc.poll() is None and store.get(RunKeys(run_id).metrics(kill_after_round, 0)) is None:
            time.sleep(0.05)
        pid = ((json.loads((run_dir / "run.json").read_text())["ranks"][GONE].get("handle") or {})
               .get("metadata") or {}).get("pid")
        if pid and proc.poll() is None:
            os.killpg(pid, signal.SIGKILL)
            killed_at = time.time()
    out, _ = proc.communicate()
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"diloco run ({name}) failed:\n{out[-4000:]}")
    return summarize(name, run_dir, wall, killed_at)


def summarize(name: str, run_dir: Path, wall: float, killed_at: float | None) -> dict:
    from diloco.store.metrics import read_rounds
    from diloco.runrecord.state import RunRecord
    from diloco.testing.scenarios import events_of

    evs = events_of(run_dir.parent.parent, run_dir.name)  # the run has ended: every line is whole
    record = json.loads((run_dir / "run.json").read_text())
    results = {r["rank"]: r["result"] for r in record["ranks"] if r.get("result")}
    if len({res["theta_digest"] for res in results.values()}) != 1:
        raise SystemExit(f"{name}: replicas disagree on θ_global")
    rounds = read_rounds(RunRecord.load(run_dir.name, run_dir.parent.parent).rendezvous, run_dir.name, final=True)
    shared = [k for k in sorted(results) if k != GONE]
    tokens = sum(row.tokens for s in rounds for row in s.rows if row.rank in shared)
    train_s = max(results[k]["wall_s"] for k in shared)
    # when each round's last member applied it (the replicas' own rows)
    ends = [(max(row.t for row in s.rows if row.member), s.round, s.members) for s in rounds]
    periods = [(b[0], b[0] - a[0]) for a, b in zip(ends[1:], ends[2:])]  # past round 1 (start-up)
    row = {"row": name, "replicas": len(results), "rounds": len(ends), "wall_s": round(wall, 1),
           "train_s": round(train_s, 1), "tokens_ranks_0_2": tokens,
           "tokens_per_s_ranks_0_2": round(tokens / train_s),
           "eval_loss": round(json.loads((run_dir / "artifacts" / "summary.json").read_text())["eval_loss"], 4),
           "round_period_s": round(statistics.median(p for _, p in periods), 3) if periods else None,
           "peak_rss_mb_per_replica": round(max(res.get("peak_rss_mb") or 0 for res in results.values()), 1) or None,
           "one_theta": True}
    if killed_at is not None:
        relaunch = min((e["t"] for e in evs if e.get("event") == "launch" and GONE in e.get("ranks", [])
                        and e.get("attempt", 0) >= 1), default=None)
        back = min((t for t, _, members in ends if relaunch and t > relaunch and GONE in members), default=None)
        gone = [p for t, p in periods if killed_at < t <= (relaunch or t)]
        row.update({
            "members_by_round": [len(m) for _, _, m in ends],
            "gone_s": round((relaunch or killed_at) - killed_at, 1),
            "round_period_while_gone_s": round(statistics.median(gone), 3) if gone else None,
            "relaunch_to_first_round_as_member_s": round(back - relaunch, 1) if back and relaunch else None,
        })
    return row


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        alone = run("3-alone", Path(tmp), 3)
        rounds = STEPS // H
        gone = run("4-one-gone", Path(tmp), 4, kill_after_round=max(1, rounds // 3), hold_s=round(alone["train_s"] / 3, 1))
    print(json.dumps({
        "bench": "gone", "sync_every": H, "total_steps": STEPS, "rows": [alone, gone],
        "gone_vs_alone": {
            # the others' rate while rank 3 is gone: rounds of equal tokens, so the ratio of periods
            "tokens_per_s_ranks_0_2_while_gone": round(alone["round_period_s"] / gone["round_period_while_gone_s"], 3)
            if gone.get("round_period_while_gone_s") and alone["round_period_s"] else None,
            # the whole run, rank 3's presence included (on shared CPU cores its compute slows the others)
            "tokens_per_s_ranks_0_2": round(gone["tokens_per_s_ranks_0_2"] / alone["tokens_per_s_ranks_0_2"], 3),
            "round_period_while_gone": round(gone["round_period_while_gone_s"] / alone["round_period_s"], 3)
            if gone.get("round_period_while_gone_s") and alone["round_period_s"] else None},
        "targets": {"tokens_per_s_ranks_0_2_while_gone vs alone": ">= 0.95",
                    "round_period_while_gone vs alone": "<= 1.05 (no round waits for the gone replica)"},
    }, indent=2))


if __name__ == "__main__":
    main()
