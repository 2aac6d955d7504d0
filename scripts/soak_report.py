"""Sum a mixed-fault soak's log (tests/test_soak.py with DILOCO_SOAK_LOG) into the figure
docs/benchmarks.md quotes: faults by kind, runs by outcome, rounds lost or applied twice, eval
loss against the fault-free run, and each kill's recovery time (median, p95, max).

    .venv/bin/python scripts/soak_report.py soak.jsonl [more.jsonl …] [--json]

A line that is not a soak run's record is named and skipped (a log cut off mid-line by a
killed soak still sums what it holds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import Any


def read(paths: list[Path]) -> list[dict[str, Any]]:
    runs = []
    for path in paths:
        for n, text in enumerate(path.read_text().splitlines(), 1):
            try:
                line = json.loads(text)
            except json.JSONDecodeError:
                line = None
            if not isinstance(line, dict) or "soak_run" not in line or not isinstance(line.get("injected"), dict):
                print(f"{path}:{n}: not a soak run's record; skipped", file=sys.stderr)
                continue
            runs.append(line)
    return runs


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile by nearest rank (q in 0..100)."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))]


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    faults: Counter[str] = Counter()
    for run in runs:
        faults.update({k: int(v) for k, v in run["injected"].items()})
    outcomes = Counter(run.get("outcome", "?") for run in runs)
    kills = [k for run in runs for k in run.get("kills", [])]
    back = [k["recovery_s"] for k in kills if k.get("recovery_s") is not None]
    deltas = [run["delta"] for run in runs if "delta" in run]
    rounds_off = [run["soak_run"] for run in runs if "rounds" in run
                  and run["rounds"] != list(range(1, run.get("expected_rounds", len(run["rounds"])) + 1))]
    return {
        "runs": len(runs),
        "outcomes": dict(outcomes),
        "faults": sum(faults.values()),
        "faults_by_kind": dict(faults.most_common()),
        "process_faults": sum(v for k, v in faults.items() if k != "store_error"),
        "relaunches": sum(run.get("relaunches", 0) for run in runs),
        "deadlocks": outcomes.get("deadlock", 0),
        "runs_with_rounds_missing": rounds_off,
        "eval_loss_delta": {"min": min(deltas), "median": statistics.median(deltas), "max": max(deltas)}
        if deltas else None,
        "recovery_s": {"kills": len(kills), "back": len(back), "median": statistics.median(back),
                       "p95": percentile(back, 95), "max": max(back)} if back else None,
    }


def markdown(s: dict[str, Any]) -> str:
    kinds = ", ".join(f"{k} {v}" for k, v in s["faults_by_kind"].items())
    lines = [f"| runs | {s['runs']} ({', '.join(f'{k} {v}' for k, v in s['outcomes'].items())}) |",
             f"| faults injected | {s['faults']} ({kinds}) |",
             f"| process and object faults (all but store errors) | {s['process_faults']} |",
             f"| relaunches | {s['relaunches']} |",
             f"| deadlocks | {s['deadlocks']} |",
             f"| runs with a round missing | {len(s['runs_with_rounds_missing'])} |"]
    if s["eval_loss_delta"]:
        d = s["eval_loss_delta"]
        lines.append(f"| eval loss vs fault-free | {d['min']:+.1%} … {d['max']:+.1%} (median {d['median']:+.1%}) |")
    if s["recovery_s"]:
        r = s["recovery_s"]
        lines.append(f"| kill → first round back (s) | median {r['median']:.1f}, p95 {r['p95']:.1f}, max {r['max']:.1f}"
                     f" ({r['back']} of {r['kills']} kills; the rest were killed again or the run ended first) |")
    return "| | |\n|---|---|\n" + "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", type=Path)
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args()
    missing = [str(p) for p in args.logs if not p.is_file()]
    if missing:
        print(f"soak_report: no such log: {', '.join(missing)}", file=sys.stderr)
        return 2
    runs = read(args.logs)
    if not runs:
        print("soak_report: the logs hold no soak run", file=sys.stderr)
        return 1
    s = summary(runs)
    print(json.dumps(s, indent=2) if args.json else markdown(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
