"""What the fault-injection tests share: the tiny-LM spec they run, starting a run, aiming a
SIGKILL at a phase, what every fault run must end with (the fault-free yardstick they compare
with is conftest's `reference`, run once a session).

The harness aims each kill at a phase — inner steps ("compute"), uploading the shards
("upload"), reducing an owned shard ("reduce"), downloading reduced shards ("gather") — using
the replica runtime's fault-injection phase marker (DILOCO_FAULT_PHASE_FILE /
DILOCO_FAULT_PHASE_DELAY, which stretches each sync phase so a kill can land inside it).
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from conftest import tiny_spec
from diloco.testing.scenarios import events_of, record_of

PHASES = ["compute", "upload", "reduce", "gather"]
STEPS, H = 300, 25
RESTART = "max_restarts = 50\nmax_restarts_per_rank = 20\nbackoff = 0.2"


def spec_for(tmp_path: Path, *, model: str = "main", replicas: int = 4) -> Path:
    """The fault runs' spec: the main job's model where a test compares losses with `reference`;
    the small one (`conftest.SMALL_MODEL`) where a test proves a rejoin, the state or incidents."""
    spec = tiny_spec(tmp_path, steps=STEPS, sync_every=H, restart=RESTART, model=model, replicas=replicas)
    text = spec.read_text().replace("round_timeout = 120", "round_timeout = 8\ncheckpoint_every = 2")
    spec.write_text(text)
    return spec


def final_results(record: dict) -> list[dict]:
    return [r["result"] for r in record["ranks"] if r["status"] == "succeeded"]


def start(spec: Path, state_dir: Path, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "diloco", "run", str(spec), "--on-interrupt", "detach"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "DILOCO_STATE_DIR": str(state_dir), **(env or {})})
    return proc, proc.stdout.readline().split()[1].rstrip(":")


def fault_free(spec: Path, state_dir: Path) -> list[dict]:
    """Every replica's result of `spec` run to its end without a fault (the yardstick a fault run's
    state or loss is held to)."""
    proc, run_id = start(spec, state_dir)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out
    return final_results(record_of(state_dir, run_id))


def recovered(proc: subprocess.Popen, out: str, state: Path, run_id: str,
              replicas: int = 4) -> tuple[dict, list[dict], list[dict]]:
    """What every fault run must end with: success, every replica surviving, holding one finite θ
    (the same after every round: no `diverged` event), nothing corrupt or non-finite read."""
    assert proc.returncode == 0, out
    record, events = record_of(state, run_id), events_of(state, run_id)
    results = final_results(record)
    assert len(results) == replicas
    assert len({r["theta_digest"] for r in results}) == 1, "survivors disagree on the global model"
    assert all(math.isfinite(r["eval_loss"]) for r in results), "a final model is not finite"
    assert not any(e["event"] == "diverged" for e in events), "replicas disagreed after some round"
    for error in (e.get("error") or "" for e in events):
        assert "CorruptObject" not in error and "RuntimeError" not in error, f"an untrusted object was used: {error}"
    return record, events, results


def wait_for_phase_round(phase_dir: Path, r: int, timeout: float = 300) -> None:
    """Wait until some replica's phase marker shows round `r` or later: a kill aimed after it
    lands in the rounds, however long the replicas took to start (under load, tens of seconds)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for marker in phase_dir.glob("phase-*"):
            try:
                if int(marker.read_text().split()[1]) >= r:
                    return
            except (OSError, IndexError, ValueError):
                pass
        time.sleep(0.05)
    raise AssertionError(f"no replica reached round {r} within {timeout} s")


def kill_in_phase(state: Path, run_id: str, phase_dir: Path, rng: random.Random, phase: str) -> dict[str, Any] | None:
    """SIGKILL one running replica when its phase marker shows `phase`; returns the kill (the
    phase hit, the round it was in, the rank, its attempt and the wall-clock time), or None if
    none landed."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            ranks = record_of(state, run_id).get("ranks") or []  # none yet: the launcher is submitting
        except (FileNotFoundError, json.JSONDecodeError):
            time.sleep(0.05)
            continue
        running = [r for r in ranks if r["status"] == "running" and r.get("handle")]
        if not running:
            time.sleep(0.05)
            continue
        victim = rng.choice(running)
        marker = phase_dir / f"phase-{victim['rank']}"
        until = time.monotonic() + 8
        while time.monotonic() < until:
            try:
                now, at = marker.read_text().split()[:2]
            except (FileNotFoundError, ValueError):
                now = at = ""
            if now == phase:
                try:
                    os.kill(victim["handle"]["metadata"]["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    break
                return {"phase": phase, "round": int(at), "rank": victim["rank"],
                        "attempt": victim["handle"]["metadata"].get("attempt", 0), "t": time.time()}
            time.sleep(0.002)
    return None


def killed_and_relaunched(spec: Path, state_dir: Path, tmp_path: Path, seed: int) -> tuple[dict[str, Any], list[dict]]:
    """A 2-replica run whose replica is SIGKILLed in its compute phase once round 2 is under way,
    each round's phases stretched (0.45 s) so the run outlasts the relaunch (a process starting,
    its trainer library imported) however loaded the machine. Returns the kill (with the run's id)
    and the run's results, once `recovered` holds (one model after every round) and a relaunch happened."""
    phase_dir = tmp_path / "phases"
    phase_dir.mkdir()
    env = {"DILOCO_FAULT_PHASE_FILE": str(phase_dir / "phase-{rank}"), "DILOCO_FAULT_PHASE_DELAY": "0.45"}
    proc, run_id = start(spec, state_dir, env)
    try:
        wait_for_phase_round(phase_dir, 2)
        hit = kill_in_phase(state_dir, run_id, phase_dir, random.Random(seed), "compute")
        out, _ = proc.communicate(timeout=900)
    finally:
        proc.kill()
    assert hit is not None
    _, events, results = recovered(proc, out, state_dir, run_id, replicas=2)
    assert sum(e["event"] == "launch" for e in events) >= 2
    return {**hit, "run_id": run_id}, results
