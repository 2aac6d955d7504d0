"""Sweep DiLoCo's outer learning rate from Python: one run per value, launched with diloco.launch
from a dict built on the tiny-LM spec, followed while it runs, compared at the end.

    .venv/bin/python examples/python-api/sweep.py                       # 0.5, 0.7, 1.0; ~2 min each
    .venv/bin/python examples/python-api/sweep.py --outer-lr 0.7 1.0 --steps 300 --replicas 2

Each run is an ordinary diloco run: `diloco status RUN` / `diloco logs RUN` work on it from any
shell, and diloco.attach(run_id) finds it from another Python process. Prints one JSON line per
run and a last line naming the best.
"""

from __future__ import annotations

import argparse
import json
import time
import tomllib
from pathlib import Path

import diloco

TINY_LM = Path(__file__).resolve().parents[1] / "tiny-lm"


def spec_for(outer_lr: float, steps: int, replicas: int) -> dict:
    spec = tomllib.loads((TINY_LM / "diloco.toml").read_text())
    spec["name"] = f"sweep-olr{outer_lr:g}"
    spec["workdir"] = str(TINY_LM)
    spec["replicas"] = replicas
    spec["args"]["eval_every"] = 0
    spec["diloco"].update(outer_lr=outer_lr, total_steps=steps)
    return spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outer-lr", type=float, nargs="+", default=[0.5, 0.7, 1.0])
    parser.add_argument("--steps", type=int, default=1500, help="inner steps per replica per run")
    parser.add_argument("--replicas", type=int, default=4)
    args = parser.parse_args()
    outcomes = []
    for outer_lr in args.outer_lr:
        run = diloco.launch(spec_for(outer_lr, args.steps, args.replicas))  # supervised in a background thread
        while not run.done:  # or simply run.wait()
            p = run.progress()
            print(f"  {run.id}: {run.state}  step {p.step}/{p.total_steps or '?'}  round {p.round}", flush=True)
            time.sleep(5)
        run.wait()  # raises diloco's RunFailed if the run failed
        results = run.results()  # what each replica's entrypoint returned
        rounds = run.rounds()    # round summaries, read from the run's store
        outcome = {"run": run.id, "outer_lr": outer_lr, "eval_loss": results[0]["eval_loss"],
                   "rounds": len(rounds), "sync_share": round(rounds[-1].sync_share or 0.0, 3),
                   "same_model_everywhere": len({r["theta_digest"] for r in results}) == 1}
        print(json.dumps(outcome), flush=True)
        outcomes.append(outcome)
    best = min(outcomes, key=lambda o: o["eval_loss"])
    print(f"best outer_lr {best['outer_lr']:g}: eval loss {best['eval_loss']:.4f} (run {best['run']})")


if __name__ == "__main__":
    main()
