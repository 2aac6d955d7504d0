"""Fault injection on the tiny-LM main job, real processes: SIGKILL replicas, kill the launcher.

The harness aims each kill at a phase — inner steps ("compute"), uploading the shards
("upload"), reducing an owned shard ("reduce"), downloading reduced shards ("gather") — using
the replica runtime's fault-injection phase marker (DILOCO_FAULT_PHASE_FILE /
DILOCO_FAULT_PHASE_DELAY, which stretches each sync phase so a kill can land inside it).

DILOCO_FAULT_RUNS and DILOCO_FAULT_KILLS scale the SIGKILL soak (CI runs the default 1 × 3;
`DILOCO_FAULT_RUNS=10` is the documented longer soak).

`test_mixed_fault_soak` mixes every fault kind in each run, on an s3:// rendezvous (moto behind
a proxy that answers a share of requests with 503 SlowDown / 500 InternalError): SIGKILLs aimed
at each phase, a SIGSTOP'd straggler held past `round_timeout` and then resumed, corrupt objects
at rest (a contribution and a reduced shard), and on every other run the launcher SIGKILLed and
resumed. CI runs one such run; the documented soak is

    DILOCO_SOAK_RUNS=20 .venv/bin/python -m pytest tests/test_fault_injection.py -k soak -s

which prints one JSON line per run (injections by kind, relaunches, eval loss against the
fault-free run) and asserts: no deadlock (every run ends within its timeout), no crash loop
(relaunches bounded by the kills), survivors bit-identical, eval loss within 3%.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import on_s3, tiny_spec

FAULT_RUNS = int(os.environ.get("DILOCO_FAULT_RUNS", "1"))
KILLS_PER_RUN = int(os.environ.get("DILOCO_FAULT_KILLS", "3"))
PHASES = ["compute", "upload", "reduce", "gather"]
STEPS, H = 300, 25
RESTART = "max_restarts = 50\nmax_restarts_per_rank = 20\nbackoff = 0.2"


def spec_for(tmp_path: Path) -> Path:
    spec = tiny_spec(tmp_path, steps=STEPS, sync_every=H, restart=RESTART)
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
    """What every fault run must end with: success, four survivors holding one θ, nothing corrupt read."""
    assert proc.returncode == 0, out
    record, events = record_of(state, run_id), events_of(state, run_id)
    results = final_results(record)
    assert len(results) == 4
    assert len({r["theta_crc32"] for r in results}) == 1, "survivors disagree on the global model"
    assert not any("CorruptObject" in (e.get("error") or "") for e in events), "a corrupt object was read"
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
    assert len(results) == 4 and len({r["theta_crc32"] for r in results}) == 1
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
# thread's round, while the main thread goes on with inner steps.
SYNC_MODES = {
    "overlap+fragments+int4": 'overlap = true\nfragments = 5\ntransport = "int4"',
    "overlap+topk": 'overlap = true\ntransport = "topk"',
    "fragments+topk": 'fragments = 5\ntransport = "topk"',
}


@pytest.mark.parametrize("mode", SYNC_MODES)
def test_a_replica_killed_mid_round_rejoins_in_every_sync_mode(tmp_path, mode):
    spec = spec_for(tmp_path)
    text = spec.read_text().replace('transport = "fp32"', SYNC_MODES[mode])
    spec.write_text(text.replace(f"total_steps = {STEPS}", f"total_steps = {STEPS // 2}"))  # enough rounds after the kill
    state, phase_dir = tmp_path / "state", tmp_path / "phases"
    phase_dir.mkdir()
    env = {"DILOCO_FAULT_PHASE_FILE": str(phase_dir / "phase-{rank}"), "DILOCO_FAULT_PHASE_DELAY": "0.15"}
    proc, run_id = start(spec, state, env)
    try:
        time.sleep(4.0)
        hit = kill_in_phase(state, run_id, phase_dir, random.Random(7), "gather")
        out, _ = proc.communicate(timeout=900)
    finally:
        proc.kill()
    assert hit == "gather"
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
    assert {r["theta_crc32"] for r in results} == {reference["theta_crc32"]}


SOAK_RUNS = int(os.environ.get("DILOCO_SOAK_RUNS", "1"))
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


@pytest.mark.parametrize("run_index", range(SOAK_RUNS))
def test_mixed_fault_soak(tmp_path, reference, s3, run_index):
    from diloco.testing.s3proxy import FaultyS3Proxy

    rng = random.Random(2000 + run_index)
    state, phase_dir = tmp_path / "state", tmp_path / "phases"
    phase_dir.mkdir()
    corrupt = [f"scatter:{rng.randint(2, 5)}:{rng.randrange(4)}:{rng.randrange(4)}", f"reduced:{rng.randint(6, 9)}:{rng.randrange(4)}"]
    corrupt = [c for c in corrupt if c.split(":")[0] == "reduced" or c.split(":")[2] != c.split(":")[3]]
    injected = {"sigkill": [], "sigstop": 0, "corrupt_object": len(corrupt), "launcher_kill": 0, "store_error": 0}
    with FaultyS3Proxy(s3["env"]["AWS_ENDPOINT_URL"], error_rate=SOAK_ERROR_RATE, seed=run_index) as proxy:
        spec = on_s3(spec_for(tmp_path), s3)
        spec.write_text(spec.read_text().replace(s3["env"]["AWS_ENDPOINT_URL"], proxy.url))
        env = {"DILOCO_FAULT_PHASE_FILE": str(phase_dir / "phase-{rank}"), "DILOCO_FAULT_PHASE_DELAY": "0.15",
               "DILOCO_FAULT_CORRUPT": ",".join(corrupt), "AWS_ENDPOINT_URL": proxy.url}
        spec.write_text(spec.read_text().replace("[env]\n", "[env]\n" + "".join(
            f'{k} = "{v}"\n' for k, v in env.items() if k.startswith("DILOCO_FAULT"))))
        proc, run_id = start(spec, state, {"AWS_ENDPOINT_URL": proxy.url})
        try:
            for k in range(6):
                time.sleep(rng.uniform(2.0, 5.0))
                if proc.poll() is not None:
                    break
                if k in (1, 4):
                    if stop_straggler(state, run_id, rng, hold_s=12.0):
                        injected["sigstop"] += 1
                    continue
                hit = kill_in_phase(state, run_id, phase_dir, rng, PHASES[(k + run_index) % len(PHASES)])
                if hit:
                    injected["sigkill"].append(hit)
                if k == 2 and run_index % 2 == 0 and proc.poll() is None:
                    proc.kill()
                    proc.wait()
                    injected["launcher_kill"] += 1
                    proc = resume(state, run_id, {"AWS_ENDPOINT_URL": proxy.url})
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
                      "eval_loss": round(results[0]["eval_loss"], 4), "reference": round(reference["eval_loss"], 4),
                      "delta": round(delta, 4)}))
    assert abs(delta) < 0.03
