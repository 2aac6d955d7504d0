"""Fault injection on the tiny-LM main job, real processes: SIGKILL replicas, kill the launcher.

The harness aims each kill at a phase — inner steps ("compute"), uploading the shards
("upload"), reducing an owned shard ("reduce"), downloading reduced shards ("gather") — using
the replica runtime's fault-injection phase marker (DILOCO_FAULT_PHASE_FILE /
DILOCO_FAULT_PHASE_DELAY, which stretches each sync phase so a kill can land inside it).

DILOCO_FAULT_RUNS and DILOCO_FAULT_KILLS scale the SIGKILL soak, which CI leaves to the mixed
soak below (its SIGKILLs aim at the same phases); `DILOCO_FAULT_RUNS=10` is the documented soak.

`test_mixed_fault_soak` mixes every fault kind in each run, on an s3:// rendezvous (moto behind
a proxy that answers a share of requests with 503 SlowDown / 500 InternalError): SIGKILLs aimed
at each phase, a SIGSTOP'd straggler held past `round_timeout` and then resumed, corrupt objects
at rest (a contribution and a reduced shard), well-formed objects of the wrong length (a
contribution and a reduced shard: a writer bug, checksums valid), a replica whose parameters go
NaN mid-round (DILOCO_FAULT_NONFINITE), and on every other run the launcher SIGKILLed and
resumed. CI runs one such run; the documented soak is

    DILOCO_SOAK_RUNS=20 .venv/bin/python -m pytest tests/test_fault_injection.py -k soak -s

(`DILOCO_SOAK_PART_MB=0.125` runs it with each replica's shard sent as 4 parts, the corrupt and
wrong-length objects aimed at parts), which prints one JSON line per run (injections by kind, relaunches, eval loss against the
fault-free run) and asserts: no deadlock (every run ends within its timeout), no crash loop
(relaunches bounded by the kills), survivors bit-identical after every round (no `diverged`
event) and at the end, a finite final model, eval loss within 3%.

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

from conftest import on_s3, tiny_spec

FAULT_RUNS = int(os.environ.get("DILOCO_FAULT_RUNS", "0"))
KILLS_PER_RUN = int(os.environ.get("DILOCO_FAULT_KILLS", "3"))
PHASES = ["compute", "upload", "reduce", "gather"]
STEPS, H = 300, 25
RESTART = "max_restarts = 50\nmax_restarts_per_rank = 20\nbackoff = 0.2"


def spec_for(tmp_path: Path) -> Path:
    spec = tiny_spec(tmp_path, steps=STEPS, sync_every=H, restart=RESTART, model="main")  # losses compared
    text = spec.read_text().replace("round_timeout = 120", "round_timeout = 8\ncheckpoint_every = 2")
    spec.write_text(text)
    return spec


def record_of(state_dir: Path, run_id: str) -> dict:
    return json.loads((state_dir / "runs" / run_id / "run.json").read_text())


def events_of(state_dir: Path, run_id: str) -> list[dict]:
    path = state_dir / "runs" / run_id / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def final_results(record: dict) -> list[dict]:
    return [r["result"] for r in record["ranks"] if r["status"] == "succeeded"]


def start(spec: Path, state_dir: Path, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "diloco", "run", str(spec), "--on-interrupt", "detach"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "DILOCO_STATE_DIR": str(state_dir), **(env or {})})
    return proc, proc.stdout.readline().split()[1].rstrip(":")


def recovered(proc: subprocess.Popen, out: str, state: Path, run_id: str) -> tuple[dict, list[dict], list[dict]]:
    """What every fault run must end with: success, four survivors holding one finite θ (the same
    after every round: no `diverged` event), nothing corrupt or non-finite read."""
    assert proc.returncode == 0, out
    record, events = record_of(state, run_id), events_of(state, run_id)
    results = final_results(record)
    assert len(results) == 4
    assert len({r["theta_digest"] for r in results}) == 1, "survivors disagree on the global model"
    assert all(math.isfinite(r["eval_loss"]) for r in results), "a final model is not finite"
    assert not any(e["event"] == "diverged" for e in events), "replicas disagreed after some round"
    for error in (e.get("error") or "" for e in events):
        assert "CorruptObject" not in error and "RuntimeError" not in error, f"an untrusted object was used: {error}"
    return record, events, results


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A fault-free run of the same spec and seed: the yardstick for loss and final state."""
    tmp = tmp_path_factory.mktemp("reference")
    state = tmp / "state"
    proc, run_id = start(spec_for(tmp), state)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out
    results = final_results(record_of(state, run_id))
    assert len(results) == 4 and len({r["theta_digest"] for r in results}) == 1
    return results[0]


def kill_in_phase(state: Path, run_id: str, phase_dir: Path, rng: random.Random, phase: str) -> str | None:
    """SIGKILL one running replica when its phase marker shows `phase`; returns the phase hit."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            ranks = record_of(state, run_id)["ranks"]
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
                now = marker.read_text().split()[0]
            except (FileNotFoundError, IndexError):
                now = ""
            if now == phase:
                try:
                    os.kill(victim["handle"]["metadata"]["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    break
                return phase
            time.sleep(0.002)
    return None


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
    print(json.dumps({"run": run_index, "kills": hits, "relaunches": sum(e["event"] == "launch" for e in events) - 1,
                      "eval_loss": results[0]["eval_loss"], "reference_eval_loss": reference["eval_loss"],
                      "delta": round(delta, 4)}))
    assert abs(delta) < 0.03


# Every sync-hiding mode, with a SIGKILL aimed at the gather: with overlap that is the background
# round, while the training loop goes on with inner steps (in the first, in a sync process: the
# kill lands on the training process, and its sync process dies with it). Each runs long enough
# for the kill (about round 2) and several rounds after the rejoin: with 5 fragments a round
# closes every 5 steps, so 60 steps are 12 rounds.
SYNC_MODES = {
    "overlap+fragments+int4, sync process": ('overlap = true\nfragments = 5\ntransport = "int4"\nexchange = "process"',
                                             60),
    "overlap+topk": ('overlap = true\ntransport = "topk"', STEPS // 2),
    "fragments+topk": ('fragments = 5\ntransport = "topk"', 60),
    "round_seconds+int8": ('round_seconds = 0.15\ntransport = "int8"', STEPS // 2),  # a round is 0.15 s, not H steps
    # each replica's shard sent as 4 parts (470k parameters, 4 replicas); killed while it reduces
    # them, so the others take over all four
    "parts, killed reducing": ('part_mb = 0.125\ntransport = "fp32"', STEPS // 2),
}
KILL_PHASE = {"parts, killed reducing": "reduce"}  # the rest: "gather"


@pytest.mark.parametrize("mode", SYNC_MODES)
def test_a_replica_killed_mid_round_rejoins_in_every_sync_mode(tmp_path, mode):
    spec = spec_for(tmp_path)
    settings, steps = SYNC_MODES[mode]
    text = spec.read_text().replace('transport = "fp32"', settings)
    spec.write_text(text.replace(f"total_steps = {STEPS}", f"total_steps = {steps}"))
    state, phase_dir = tmp_path / "state", tmp_path / "phases"
    phase_dir.mkdir()
    env = {"DILOCO_FAULT_PHASE_FILE": str(phase_dir / "phase-{rank}"), "DILOCO_FAULT_PHASE_DELAY": "0.15"}
    proc, run_id = start(spec, state, env)
    try:
        time.sleep(4.0)
        hit = kill_in_phase(state, run_id, phase_dir, random.Random(7), KILL_PHASE.get(mode, "gather"))
        out, _ = proc.communicate(timeout=900)
    finally:
        proc.kill()
    assert hit == KILL_PHASE.get(mode, "gather")
    record, events, results = recovered(proc, out, state, run_id)
    assert any(e["event"] == "failed" for e in events) and sum(e["event"] == "launch" for e in events) >= 2
    assert all(r["rounds"] == results[0]["rounds"] for r in results)  # the relaunched one caught up


def test_launcher_killed_mid_run_then_resumed_reaches_the_same_state(tmp_path, reference):
    state = tmp_path / "state"
    proc, run_id = start(spec_for(tmp_path), state)
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
    assert {r["theta_digest"] for r in results} == {reference["theta_digest"]}


def short_spec(tmp_path: Path, steps: int) -> Path:
    spec = spec_for(tmp_path)
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


SOAK_RUNS = int(os.environ.get("DILOCO_SOAK_RUNS", "1"))
SOAK_PART_MB = os.environ.get("DILOCO_SOAK_PART_MB")  # `[diloco] part_mb` of the soak's runs (unset: one object a shard)
SOAK_ERROR_RATE = float(os.environ.get("DILOCO_SOAK_ERROR_RATE", "0.02"))


def stop_straggler(state: Path, run_id: str, rng: random.Random, hold_s: float) -> bool:
    """SIGSTOP one running replica for `hold_s` (past round_timeout), then SIGCONT it."""
    try:
        running = [r for r in record_of(state, run_id)["ranks"] if r["status"] == "running" and r.get("handle")]
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    if not running:
        return False
    pid = rng.choice(running)["handle"]["metadata"]["pid"]
    try:
        os.kill(pid, signal.SIGSTOP)
        time.sleep(hold_s)
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        return False
    return True


def resume(state: Path, run_id: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "diloco", "resume", run_id, "--on-interrupt", "detach"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "DILOCO_STATE_DIR": str(state), **env})


def soak_part(fault: str, run_index: int) -> str:
    """A fault aimed at shard o (`kind:round:o[:src]`) aimed at one of o's parts instead."""
    from diloco.wiresize import parts_per_shard

    parts = parts_per_shard(470_528, 4, float(SOAK_PART_MB))  # the main job's model, 4 replicas
    kind, r, owner, *src = fault.split(":")
    return ":".join([kind, r, str(int(owner) * parts + run_index % parts), *src])


@pytest.mark.parametrize("run_index", range(SOAK_RUNS))
def test_mixed_fault_soak(tmp_path, reference, s3, run_index):
    from diloco.testing.s3proxy import FaultyS3Proxy

    rng = random.Random(2000 + run_index)
    state, phase_dir = tmp_path / "state", tmp_path / "phases"
    phase_dir.mkdir()
    corrupt = [f"scatter:{rng.randint(2, 5)}:{rng.randrange(4)}:{rng.randrange(4)}", f"reduced:{rng.randint(6, 9)}:{rng.randrange(4)}"]
    corrupt = [c for c in corrupt if c.split(":")[0] == "reduced" or c.split(":")[2] != c.split(":")[3]]
    # drawn after the draws above, so a seed's earlier injections stay what they were
    owner = rng.randrange(4)
    wrong_length = [f"scatter:10:{owner}:{(owner + 1 + rng.randrange(3)) % 4}", f"reduced:11:{rng.randrange(4)}"]
    scatter_round = int(corrupt[0].split(":")[1]) if corrupt[0].startswith("scatter") else -1
    if SOAK_PART_MB:  # aim at parts: shard s of replica o is part o·P + (run mod P); no draw, so seeds stay
        corrupt, wrong_length = [soak_part(c, run_index) for c in corrupt], [soak_part(c, run_index) for c in wrong_length]
    nan_rank, nan_round = rng.randrange(4), rng.choice([k for k in range(3, 10) if k != scatter_round])
    nan_step = (nan_round - 1) * H + rng.randint(5, H - 5)
    injected = {"sigkill": [], "sigstop": 0, "corrupt_object": len(corrupt), "wrong_length": len(wrong_length),
                "nonfinite": 1, "launcher_kill": 0, "store_error": 0}
    with FaultyS3Proxy(s3["env"]["AWS_ENDPOINT_URL"], error_rate=SOAK_ERROR_RATE, seed=run_index) as proxy:
        spec = on_s3(spec_for(tmp_path), s3)
        if SOAK_PART_MB:
            spec.write_text(spec.read_text().replace('transport = "fp32"', f'part_mb = {SOAK_PART_MB}\ntransport = "fp32"'))
        # the launcher's shell: the store's endpoint (a `secrets` entry) and the fault injections,
        # which local replicas inherit (a relaunch by a resumed launcher too)
        env = {"DILOCO_FAULT_PHASE_FILE": str(phase_dir / "phase-{rank}"), "DILOCO_FAULT_PHASE_DELAY": "0.15",
               "DILOCO_FAULT_CORRUPT": ",".join(corrupt), "DILOCO_FAULT_WRONG_LENGTH": ",".join(wrong_length),
               "DILOCO_FAULT_NONFINITE": f"{nan_rank}:{nan_step}", "AWS_ENDPOINT_URL": proxy.url}
        proc, run_id = start(spec, state, env)
        try:
            for k in range(6):
                time.sleep(rng.uniform(2.0, 5.0))
                if proc.poll() is not None:
                    break
                if k in (1, 4):  # the second is kept away for many rounds (they go on without it)
                    if stop_straggler(state, run_id, rng, hold_s=12.0 if k == 1 else 25.0):
                        injected["sigstop"] += 1
                    continue
                hit = kill_in_phase(state, run_id, phase_dir, rng, PHASES[(k + run_index) % len(PHASES)])
                if hit:
                    injected["sigkill"].append(hit)
                if k == 2 and run_index % 2 == 0 and proc.poll() is None:
                    proc.kill()
                    proc.wait()
                    injected["launcher_kill"] += 1
                    proc = resume(state, run_id, env)
            out, _ = proc.communicate(timeout=900)  # a deadlock fails here
        finally:
            proc.kill()
        injected["store_error"] = proxy.injected
    record, events, results = recovered(proc, out, state, run_id)
    relaunches = sum(r["restarts"] for r in record["ranks"])
    assert relaunches <= len(injected["sigkill"]) + injected["sigstop"] + 1, "a crash loop: relaunches beyond the faults"
    delta = results[0]["eval_loss"] / reference["eval_loss"] - 1
    incidents = [e for e in events if e["event"] == "incident"]
    print(json.dumps({"soak_run": run_index, "injected": {**injected, "sigkill": len(injected["sigkill"])},
                      "kill_phases": injected["sigkill"], "relaunches": relaunches, "incidents": len(incidents),
                      "nonfinite": [nan_rank, nan_round], "eval_loss": round(results[0]["eval_loss"], 4),
                      "reference": round(reference["eval_loss"], 4), "delta": round(delta, 4)}))
    assert abs(delta) < 0.03
    problems = " ".join(e["problem"] for e in incidents)
    # (a writer killed at its round writes no damaged object; all of them missing means none was injected)
    assert "checksum" in problems or "wrong layout" in problems, "the soak's object faults were not injected"
    # the NaN replica was left out and reset, unless a relaunch reset it first (a SIGKILL in between):
    # its own row says it reset, or (when the round was rebuilt from the rows in before the
    # paused replica's own came: the others went on without it) the reducers that left it out say so
    reset = [e for e in incidents if e.get("replica") == nan_rank and
             ("reset its model" in e["action"] or f"rank {nan_rank} resets to θ_global" in e["action"])]
    assert reset or next(r for r in record["ranks"] if r["rank"] == nan_rank)["restarts"] > 0, incidents
