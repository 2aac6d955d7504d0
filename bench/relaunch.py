"""A relaunch under the main job's load: from the launcher seeing a replica's exit to its next attempt.

The main job (examples/tiny-lm, 4 local replicas, the TensorBoard sink when tensorboardX is
installed, as the README's setup installs it) runs through `diloco run`; once the launcher has
recorded round `BENCH_KILL_AFTER_ROUND` (5: ~30 s in), rank 1's process is SIGKILLed. From the run's events: the seconds from the launcher seeing
the exit (`failed`) to the relaunch's submission returning (`launch` of attempt 1), against the
`[restart] backoff` (1 s; target: within backoff + 0.3 s), and to rank 1 being back as a member
of a round (its next round's row). Once with warm start (replicas forked from a template) and
once with `warm_start = false` (fresh interpreters). Host memory: the peak Pss of the whole run
(launcher, template, replicas) in each row.

`BENCH_BASELINE=<git rev>` also runs each row on that revision's code (a worktree of it first on
PYTHONPATH, plugins other than the built-in local backend left out), in the same bench run.

    .venv/bin/python bench/relaunch.py                          # ~6 minutes on 2 cores
    BENCH_BASELINE=e20eb84 .venv/bin/python bench/relaunch.py   # and the code before issue 65
    BENCH_QUICK=1 .venv/bin/python bench/relaunch.py            # a smoke run: a small model, 2 replicas
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import QUICK, HostMemory, baseline_sources, knob, tiny_lm_spec, toml_text  # noqa: E402

KILL_AFTER_ROUND = int(knob("BENCH_KILL_AFTER_ROUND", "5", "1"))  # round 5: ~30 s into the main job
BACKOFF = 1.0
TARGET_S = BACKOFF + 0.3
BASELINE = os.environ.get("BENCH_BASELINE", "")


def spec_for(warm: bool) -> dict:
    """The main job's spec with the backoff pinned and warm start on or off."""
    spec = tiny_lm_spec(diloco={} if not QUICK else {"total_steps": 400})  # quick: rounds left after the kill
    spec["backend"] = {"name": "local", "warm_start": warm}
    spec["restart"] = {**spec.get("restart", {}), "backoff": BACKOFF}
    return spec


def one(warm: bool, code: str, pythonpath: list[str], tmp: Path) -> dict:
    state = tmp / f"state-{code}-{warm}"
    spec = tmp / f"{code}-{warm}.toml"
    text = spec_for(warm)
    if pythonpath:  # the baseline's own example: today's imports today's module paths
        text["workdir"] = str(Path(pythonpath[0]).parents[2] / "examples" / "tiny-lm")
    spec.write_text(toml_text(text))
    env = {**os.environ, "DILOCO_STATE_DIR": str(state)}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([*pythonpath, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env["DILOCO_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # the backends here speak today's core, not the baseline's
    memory = HostMemory(every=0.5)
    t0 = time.monotonic()
    launcher = subprocess.Popen([sys.executable, "-m", "diloco", "run", str(spec), "--on-interrupt", "cancel"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    killed = None
    while killed is None and launcher.poll() is None:
        time.sleep(0.2)
        runs = list((state / "runs").glob("*/events.jsonl")) if (state / "runs").is_dir() else []
        if runs and any(e.get("event") == "round" and e.get("round", 0) >= KILL_AFTER_ROUND
                        for e in map(json.loads, runs[0].read_text().splitlines()[:-1])):
            ranks = json.loads((runs[0].parent / "run.json").read_text())["ranks"]
            os.killpg(int(ranks[1]["handle"]["metadata"]["pid"]), signal.SIGKILL)
            killed = time.time()
    out, _ = launcher.communicate(timeout=1800)
    peak = memory.mark()
    memory.stop()
    if launcher.returncode != 0 or killed is None:
        raise SystemExit(f"diloco run ({code}, warm={warm}) failed or ended before the kill:\n{out[-4000:]}")
    run_dir = next((state / "runs").iterdir())
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    try:
        seen = next(e["t"] for e in events if e["event"] == "failed" and e["rank"] == 1)
        launched = next(e["t"] for e in events if e["event"] == "launch" and e.get("attempt") == 1)
    except StopIteration:
        raise SystemExit(f"rank 1 was not relaunched ({code}, warm={warm}); the run's events:\n"
                         + "\n".join(json.dumps(e) for e in events)) from None
    back = [e for e in events if e["event"] == "round" and 1 in (e.get("members") or []) and e["t"] > launched]
    return {"code": code, "warm_start": warm, "replicas": spec_for(warm)["replicas"], "backoff_s": BACKOFF,
            "exit_seen_after_kill_s": round(seen - killed, 2), "seen_to_relaunch_s": round(launched - seen, 2),
            "relaunch_past_backoff_s": round(launched - seen - BACKOFF, 2),
            "kill_to_back_as_member_s": round(back[0]["t"] - killed, 1) if back else None,
            "host_memory_peak_gb": round(peak / 1e9, 2), "wall_s": round(time.monotonic() - t0, 1)}


def main() -> None:
    rows = []
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        codes = [("current", [])] + ([(BASELINE, baseline_sources(stack, BASELINE))] if BASELINE else [])
        for warm in (True, False):
            for code, path in codes:
                rows.append(one(warm, code, path, tmp))
    current = [r for r in rows if r["code"] == "current"]
    print(json.dumps({
        "bench": "relaunch", "kill_after_round": KILL_AFTER_ROUND, "loadavg_1_5_15": os.getloadavg(), "rows": rows,
        "targets": {"seen_to_relaunch_s": f"<= backoff + 0.3 = {TARGET_S} s, warm start on and off",
                    "met": all(r["seen_to_relaunch_s"] <= TARGET_S for r in current)},
    }, indent=2))


if __name__ == "__main__":
    main()
