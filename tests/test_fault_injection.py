"""Fault injection on the tiny-LM main job, real processes: SIGKILL replicas (aimed at a phase,
`fault_harness`), kill the launcher, untrusted objects and NaN replicas on their own.

DILOCO_FAULT_RUNS and DILOCO_FAULT_KILLS scale the SIGKILL soak, which CI leaves to the mixed
soak (test_soak.py, whose SIGKILLs aim at the same phases); `DILOCO_FAULT_RUNS=10` is the
documented soak.

`test_untrusted_objects_are_incidents_and_the_run_succeeds` and
`test_every_replica_gone_nan_fails_the_run_with_one_line` check the NaN and wrong-length
injections on their own, as a user sees them: events.jsonl and the run's outcome.
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

import pytest

from diloco.testing.scenarios import events_of, record_of
from fault_harness import (H, PHASES, STEPS, fault_free, final_results, kill_in_phase, recovered, spec_for,
                           start, wait_for_phase_round)

FAULT_RUNS = int(os.environ.get("DILOCO_FAULT_RUNS", "0"))
KILLS_PER_RUN = int(os.environ.get("DILOCO_FAULT_KILLS", "3"))


@pytest.mark.parametrize("run_index", range(FAULT_RUNS))
def test_random_sigkills_never_break_the_run(tmp_path, reference, run_index):
    rng = random.Random(1000 + run_index)
    state, phase_dir = tmp_path / "state", tmp_path / "phases"
    phase_dir.mkdir()
    env = {"DILOCO_FAULT_PHASE_FILE": str(phase_dir / "phase-{rank}"), "DILOCO_FAULT_PHASE_DELAY": "0.15"}
    proc, run_id = start(spec_for(tmp_path), state, env)
    hits = []
    try:
        for k in range(KILLS_PER_RUN):
            time.sleep(rng.uniform(2.0, 6.0))
            if proc.poll() is not None:
                break
            hit = kill_in_phase(state, run_id, phase_dir, rng, PHASES[(k + run_index) % len(PHASES)])
            if hit:
                hits.append(hit)
        out, _ = proc.communicate(timeout=900)
    finally:
        proc.kill()
    record, events, results = recovered(proc, out, state, run_id)
    failures = [e for e in events if e["event"] == "failed"]
    assert len(failures) >= len(hits) and len(hits) >= 1
    delta = results[0]["eval_loss"] / reference["eval_loss"] - 1
    relaunches = sum(e["event"] == "launch" for e in events) - 1
    print(json.dumps({"run": run_index, "kills": [h["phase"] for h in hits], "relaunches": relaunches,
                      "eval_loss": results[0]["eval_loss"], "reference_eval_loss": reference["eval_loss"],
                      "delta": round(delta, 4)}))
    assert abs(delta) < 0.03


# Every sync-hiding mode, with a SIGKILL aimed at the gather: with overlap that is the background
# round, while the training loop goes on with inner steps (in the first, in a sync process: the
# kill lands on the training process, and its sync process dies with it). No loss is compared, so
# three replicas of the small model. The kill is aimed once round 2 is under way, and the run lasts
# long enough for several rounds after the rejoin: 300 steps are 12 rounds, and with 5 fragments
# a round closes every 5 steps, so 80 steps are 16.
SYNC_MODE_REPLICAS = 3
SYNC_MODES = {
    "overlap+fragments+int4, sync process": ('overlap = true\nfragments = 5\ntransport = "int4"\nexchange = "process"',
                                             80),
    "overlap+topk, merged at a fixed step": ('overlap = true\noverlap_delay = 2\ntransport = "topk"', STEPS),
    "fragments+topk": ('fragments = 5\ntransport = "topk"', 80),
    "round_seconds+int8": ('round_seconds = 0.15\ntransport = "int8"', STEPS),  # a round is 0.15 s, not H steps
    # each replica's shard sent as 4 parts (checked below); killed while it reduces them, so the
    # others take over all four
    "parts, killed reducing": ('part_mb = 0.03\ntransport = "fp32"', STEPS),
}
KILL_PHASE = {"parts, killed reducing": "reduce"}  # the rest: "gather"


def test_the_parts_mode_sends_each_shard_as_four_parts():
    from conftest import SMALL_MODEL
    from diloco.store.wiresize import parts_per_shard

    parameters = int(SMALL_MODEL["parameters = 470528"].split("=")[1])
    assert parts_per_shard(parameters, SYNC_MODE_REPLICAS, 0.03) == 4


@pytest.mark.parametrize("mode", SYNC_MODES)
def test_a_replica_killed_mid_round_rejoins_in_every_sync_mode(tmp_path, mode):
    spec = spec_for(tmp_path, model="small", replicas=SYNC_MODE_REPLICAS)
    settings, steps = SYNC_MODES[mode]
    text = spec.read_text().replace('transport = "fp32"', settings)
    spec.write_text(text.replace(f"total_steps = {STEPS}", f"total_steps = {steps}"))
    state, phase_dir = tmp_path / "state", tmp_path / "phases"
    phase_dir.mkdir()
    env = {"DILOCO_FAULT_PHASE_FILE": str(phase_dir / "phase-{rank}"), "DILOCO_FAULT_PHASE_DELAY": "0.15"}
    proc, run_id = start(spec, state, env)
    try:
        wait_for_phase_round(phase_dir, 2)
        hit = kill_in_phase(state, run_id, phase_dir, random.Random(7), KILL_PHASE.get(mode, "gather"))
        out, _ = proc.communicate(timeout=900)
    finally:
        proc.kill()
    assert hit is not None and hit["phase"] == KILL_PHASE.get(mode, "gather")
    record, events, results = recovered(proc, out, state, run_id, replicas=SYNC_MODE_REPLICAS)
    assert any(e["event"] == "failed" for e in events) and sum(e["event"] == "launch" for e in events) >= 2
    assert all(r["rounds"] == results[0]["rounds"] for r in results)  # the relaunched one caught up


def test_launcher_killed_mid_run_then_resumed_reaches_the_same_state(tmp_path):
    """Bit for bit the state of the same spec run without a fault. On the small model: what is
    compared is θ_global's digest, not a loss, and the fault-free run is this test's own (the
    session's `reference` is of the main job's model, which the soak's loss comparison needs)."""
    clean = tmp_path / "clean"
    clean.mkdir()
    expected = {r["theta_digest"] for r in fault_free(spec_for(clean, model="small"), clean / "state")}
    assert len(expected) == 1
    state = tmp_path / "state"
    # each sync phase stretched by a sleep (the harness's phase marker): 12 rounds of the small model
    # last seconds longer, so a starved test process still finds the run going when it kills the
    # launcher after round 3; sleeps change no byte of θ_global
    phases = {"DILOCO_FAULT_PHASE_FILE": str(tmp_path / "phase-{rank}"), "DILOCO_FAULT_PHASE_DELAY": "0.1"}
    proc, run_id = start(spec_for(tmp_path, model="small"), state, phases)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if any(e["event"] == "round" and e["round"] >= 3 for e in events_of(state, run_id)):
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = subprocess.run([sys.executable, "-m", "diloco", "resume", run_id], capture_output=True, text=True,
                             env={**os.environ, "DILOCO_STATE_DIR": str(state)}, timeout=900)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    results = final_results(record_of(state, run_id))
    assert len(results) == 4
    assert {r["theta_digest"] for r in results} == expected


def short_spec(tmp_path: Path, steps: int) -> Path:
    """The fault spec, `steps` long, on the small model: these runs' faults are keyed to steps and
    rounds, and no loss is compared with the reference."""
    spec = spec_for(tmp_path, model="small")
    spec.write_text(spec.read_text().replace(f"total_steps = {STEPS}", f"total_steps = {steps}"))
    return spec


def round_of(step: int) -> int:
    return step // H + 1


def test_untrusted_objects_are_incidents_and_the_run_succeeds(tmp_path):
    """Rank 2's parameters go NaN mid-round 3 (its AdamW moments follow); a contribution of round 2
    and a reduced shard of round 4 are re-packed one element too long (checksums valid). Before
    issue 24 the first made every model NaN in a run that "succeeded", the others crashed the
    reducer until the restarts ran out. Now: incidents, a reset, no crash, one finite model."""
    nan_step = 2 * H + 10
    env = {"DILOCO_FAULT_NONFINITE": f"2:{nan_step}", "DILOCO_FAULT_WRONG_LENGTH": "scatter:2:0:1,reduced:4:3"}
    proc, run_id = start(short_spec(tmp_path, 6 * H), tmp_path / "state", env)
    try:
        out, _ = proc.communicate(timeout=900)
    finally:
        proc.kill()
    record, events, results = recovered(proc, out, tmp_path / "state", run_id)
    assert not any(e["event"] in ("failed", "relaunch_scheduled") for e in events), out  # nothing crashed
    incidents = [e for e in events if e["event"] == "incident"]
    nan_round = round_of(nan_step)
    left_out = [e for e in incidents if "non-finite" in e["problem"] and "left out" in e["action"]]
    assert left_out and all(e["round"] == nan_round and e["replica"] == 2 for e in left_out), incidents
    assert all(e["object"].startswith(f"{run_id}/r{nan_round:08d}/scatter/") and e["object"].endswith("/2.0")
               for e in left_out)
    reset = [e for e in incidents if "reset its model and inner optimizer state" in e["action"]]
    assert [(e["round"], e["replica"]) for e in reset] == [(nan_round, 2)]
    layout = {e["object"].split("/", 1)[1]: e["action"] for e in incidents if "wrong layout" in e["problem"]}
    assert set(layout) == {"r00000002/scatter/0/1.0", "r00000004/reduced/3/mean"}, incidents
    assert "left out" in layout["r00000002/scatter/0/1.0"] and "re-published" in layout["r00000004/reduced/3/mean"]
    losses = {e["round"]: e["loss"] for e in events if e["event"] == "round"}
    assert all(math.isfinite(loss) for rnd, loss in losses.items() if rnd > nan_round), losses
    assert all(r["rounds"] == 6 for r in results)


def test_every_replica_gone_nan_fails_the_run_with_one_line(tmp_path):
    """Training diverges on every replica at once: no finite global state can follow, and
    relaunching would meet the same NaN again. The run fails at once, saying why, no crash loop."""
    env = {"DILOCO_FAULT_NONFINITE": ",".join(f"{rank}:{H + 5}" for rank in range(4))}
    proc, run_id = start(short_spec(tmp_path, 6 * H), tmp_path / "state", env)
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode != 0, out
    events = events_of(tmp_path / "state", run_id)
    [failed] = [e for e in events if e["event"] == "run_failed"]
    assert "every contribution" in failed["reason"] and "non-finite" in failed["reason"], failed
    assert not any(e["event"] == "relaunch_scheduled" for e in events), "relaunched a run that cannot recover"
    assert record_of(tmp_path / "state", run_id)["state"] == "FAILED"
    assert "Traceback" not in out and "non-finite" in out
