"""A run that grows and shrinks while it trains (`diloco scale`), end to end.

Real launches of the tiny-LM main job (its small model) through `diloco run`, resized from
another shell with `diloco scale`: new replicas load the global state and join at a round, the
retired ones leave after theirs and exit 0. What a user would notice is checked from the run's
own record and store: every round's members hold bit-identical θ_global and momentum (the
replicas' state digests), no round is repeated or skipped, nothing is relaunched that should
not be, and the loss is no worse than a run of fixed size on the same number of tokens.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import tiny_spec

from diloco.store.metrics import read_rounds
from diloco.runrecord.state import RunRecord

pytest.importorskip("torch")

STEPS, H = 1000, 10  # long enough for new replicas to start (seconds) while a round takes ~0.3 s
TOKENS_PER_STEP = 8 * 32  # the small model's batch × context


def start(spec: Path, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "diloco", "run", str(spec)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})
    first = proc.stdout.readline()
    assert first.startswith("run "), first
    return proc, first.split()[1].rstrip(":")


def events(state_dir: Path, run_id: str) -> list[dict]:
    path = state_dir / "runs" / run_id / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def wait_for(state_dir: Path, run_id: str, what, timeout: float = 240) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in events(state_dir, run_id):
            if what(e):
                return e
        time.sleep(0.1)
    raise AssertionError(f"{run_id}: no such event within {timeout}s: {[e['event'] for e in events(state_dir, run_id)]}")


def scale(cli, run_id: str, n: int, *extra: str) -> str:
    out = cli("scale", run_id, str(n), *extra)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def check_rounds(store: str, run_id: str) -> list:
    """Every round once, in order; each round's members agree on θ_global and the momentum."""
    rounds = read_rounds(store, run_id, final=True)
    assert [s.round for s in rounds] == list(range(1, len(rounds) + 1))
    for s in rounds:
        assert s.diverged is None and len({row.state_digest for row in s.rows}) == 1, (s.round, s.rows)
        assert {row.rank for row in s.rows if row.member} <= set(s.members)  # a member killed mid-round writes no row
    return rounds


def test_a_run_grows_from_two_to_four_and_shrinks_back_while_it_trains(tmp_path, cli, state_dir):
    spec = tiny_spec(tmp_path, steps=STEPS, sync_every=H, replicas=2)
    proc, run_id = start(spec)
    wait_for(state_dir, run_id, lambda e: e["event"] == "round" and e["round"] >= 3)
    assert "applies it within seconds" in scale(cli, run_id, 4)
    grown = wait_for(state_dir, run_id, lambda e: e["event"] == "round" and len(e["members"]) == 4)
    scale(cli, run_id, 2)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    record = RunRecord.load(run_id, state_dir)
    scaled = [e for e in events(state_dir, run_id) if e["event"] == "scaled"]
    assert [(e["replicas_from"], e["replicas_to"], e["added"], e["retired"]) for e in scaled] == [
        (2, 4, [2, 3], []), (4, 2, [], [2, 3])]
    assert not [e for e in events(state_dir, run_id) if e["event"] == "relaunch_scheduled"]
    ranks = {st.rank: st for st in record.ranks}
    assert sorted(ranks) == [0, 1, 2, 3] and all(st.status == "succeeded" and st.restarts == 0 for st in ranks.values())
    assert [r for r, st in ranks.items() if st.retired] == [2, 3]
    rounds = check_rounds(record.rendezvous, run_id)
    sizes = [len(s.members) for s in rounds]
    assert sizes[0] == 2 and 4 in sizes and sizes[-1] == 2 and rounds[-1].round == STEPS // H
    first4 = sizes.index(4)  # each new replica comes in at the first round decided after it announced itself
    assert sizes[:first4] == sorted(sizes[:first4]) and set(sizes[:first4]) <= {2, 3} and grown["round"] == first4 + 1
    # the retired replicas took part in the round they were in, then left: never a lost round
    last4 = max(i for i, n in enumerate(sizes) if n == 4)
    assert set(sizes[last4 + 1:]) == {2}
    # no worse than a run of four replicas throughout, on as many tokens (+3%)
    tokens = sum(row.tokens for s in rounds for row in s.rows)
    fixed_steps = max(H, round(tokens / (4 * TOKENS_PER_STEP) / H) * H)
    (tmp_path / "fixed").mkdir()
    fixed = cli("run", str(tiny_spec(tmp_path / "fixed", steps=fixed_steps, sync_every=H, replicas=4)))
    assert fixed.returncode == 0, fixed.stdout
    fixed_id = fixed.stdout.split()[1].rstrip(":")
    loss = ranks[0].result["eval_loss"]
    fixed_loss = RunRecord.load(fixed_id, state_dir).ranks[0].result["eval_loss"]
    print(json.dumps({"members_by_round": sizes, "tokens": tokens, "eval_loss": round(loss, 4),
                      "fixed_4": {"steps": fixed_steps, "eval_loss": round(fixed_loss, 4)},
                      "delta": round(loss / fixed_loss - 1, 4)}))
    assert loss <= fixed_loss * 1.03, (loss, fixed_loss, tokens, fixed_steps)


def test_a_replica_killed_while_the_run_grows_rejoins_and_a_shrink_asked_with_no_launcher_is_applied_on_resume(
        tmp_path, cli, state_dir):
    """Grow 2 → 3 and SIGKILL the new replica in its first round: it is relaunched and rejoins.
    Then kill the launcher, ask for 2 again while none runs, and `diloco resume` applies it."""
    phases = tmp_path / "phases"
    phases.mkdir()
    # twice the usual length: no round waits for the killed replica, so the run must outlast killing
    # the launcher and resuming it for the shrink to land while it trains
    steps = 2 * STEPS
    spec = tiny_spec(tmp_path, steps=steps, sync_every=H, replicas=2,
                     extra=f'\n[env]\nDILOCO_FAULT_PHASE_FILE = "{phases}/phase-{{rank}}"\n')
    proc, run_id = start(spec)
    wait_for(state_dir, run_id, lambda e: e["event"] == "round" and e["round"] >= 2)
    scale(cli, run_id, 3)
    marker, killed, deadline = phases / "phase-2", None, time.monotonic() + 240
    while killed is None and time.monotonic() < deadline:  # the new replica, in its first round's upload
        try:
            phase, r, pid = marker.read_text().split()
        except (FileNotFoundError, ValueError):
            time.sleep(0.01)
            continue
        if phase in ("upload", "reduce", "gather"):
            os.kill(int(pid), signal.SIGKILL)
            killed = int(r)
        time.sleep(0.005)
    assert killed is not None
    wait_for(state_dir, run_id, lambda e: e["event"] == "round" and e["round"] > killed + 1 and len(e["members"]) == 3)
    proc.send_signal(signal.SIGKILL)  # the launcher dies; its replicas train on
    proc.communicate(timeout=30)
    assert "`diloco resume" in scale(cli, run_id, 2)
    assert len([e for e in events(state_dir, run_id) if e["event"] == "scaled"]) == 1  # not applied yet
    resumed = cli("resume", run_id)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    scaled = [e for e in events(state_dir, run_id) if e["event"] == "scaled"]
    assert [(e["replicas_from"], e["replicas_to"], e["added"], e["retired"]) for e in scaled] == [
        (2, 3, [2], []), (3, 2, [], [2])]
    record = RunRecord.load(run_id, state_dir)
    ranks = {st.rank: st for st in record.ranks}
    assert record.state == "SUCCEEDED" and ranks[2].restarts == 1 and ranks[2].retired
    assert all(st.status == "succeeded" for st in ranks.values())
    rounds = check_rounds(record.rendezvous, run_id)
    assert 3 in [len(s.members) for s in rounds] and len(rounds[-1].members) == 2 and rounds[-1].round == steps // H
    assert len({ranks[r].result["theta_digest"] for r in (0, 1)}) == 1  # the two that trained to the end


def test_a_wrong_scale_request_is_one_line_and_changes_nothing(tmp_path, cli, state_dir):
    spec = tiny_spec(tmp_path, steps=STEPS, sync_every=H, replicas=2)
    proc, run_id = start(spec)
    try:
        wait_for(state_dir, run_id, lambda e: e["event"] == "round")  # (a run before its first round: a unit test)
        for args, expected in [(["5000"], "replicas must be a whole number from 0 to 4096"),
                               (["0"], "that leaves the run 0 replicas"),
                               (["2", "--group", "nosuch"], "has no group 'nosuch'")]:
            out = cli("scale", run_id, *args)
            assert out.returncode == 2 and out.stderr.startswith("error: ") and expected in out.stderr, out.stderr
            assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
        folder = state_dir / "runs" / run_id / "scale"
        assert not folder.exists() or not list(folder.iterdir())  # nothing recorded
    finally:
        cli("cancel", run_id)
        proc.communicate(timeout=300)
    ended = cli("scale", run_id, "3")
    assert ended.returncode == 2 and "has ended (STOPPED)" in ended.stderr
