"""Time limits and cancels from outside diloco: lifecycle events, not the run's end.

A scripted executor on a fake clock checks the supervisor's wiring (events, budgets, the window in
which every replica cancelled from outside stops the run, `on_presence`); real local processes
check the same through the CLI: a replica past the spec's `timeout`, one cancelled outside diloco,
all of them cancelled outside diloco.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from diloco.supervise.policy import ALL_CANCELLED_WINDOW, RunState
from diloco.protocol import Capabilities, ReplicaHandle, ReplicaResult, ReplicaStatus
from diloco.request import LaunchPlan, LaunchRequest
from diloco.runrecord.state import RunRecord
from diloco.supervise.supervisor import Supervisor

from conftest import marker_spec, status_json, wait_until


class Scripted:
    """An executor whose replicas do what the test sets: `now[(rank, attempt)]` is a status, or
    (status, exit code, error) for an attempt that ended; unset attempts are running."""

    backend_name = "scripted"
    capabilities = Capabilities(shares_launcher_filesystem=False, relaunches_one_rank=True, status_detail=True)

    def __init__(self):
        self.now: dict[tuple[int, int], object] = {}
        self.cancelled: list[tuple[int, int]] = []

    def plan(self, request):
        return LaunchPlan(self.backend_name, request, {"ranks": list(request.ranks)})

    def submit(self, plan):
        return [ReplicaHandle(r, self.backend_name, {"attempt": plan.request.attempt}) for r in plan.request.ranks]

    def _state(self, h):
        got = self.now.get((h.rank, h.attempt), ReplicaStatus.RUNNING)
        return got if isinstance(got, tuple) else (got, None, None)

    def poll(self, handle):
        return self._state(handle)[0]

    def collect(self, handles, *, timeout=None):
        return [ReplicaResult(h.rank, *self._state(h), None, h.attempt) for h in handles]

    def status_detail(self, handle):
        return "cancelled by uid 1000 (scancel)" if self.poll(handle) is ReplicaStatus.CANCELLED else None

    def stream_logs(self, handle, *, n_lines=200):
        return ""

    def cancel(self, handle):
        self.cancelled.append((handle.rank, handle.attempt))
        self.now[(handle.rank, handle.attempt)] = ReplicaStatus.CANCELLED


CANCELLED = (ReplicaStatus.CANCELLED, None, "cancelled")
TIMED_OUT = (ReplicaStatus.FAILED, 124, "Slurm job 9 reached its Slurm time limit (TIMEOUT; sbatch --time)")
DONE = (ReplicaStatus.SUCCEEDED, 0, None)


def supervised(restart=None, n=2):
    now = [1000.0]
    ex = Scripted()
    record = RunRecord.create("scripted", {})
    request = LaunchRequest(run_id="scripted", n_replicas=n, entrypoint="x:y", timeout=60)
    sup = Supervisor(ex, record, request, {"backoff": 0, **(restart or {})}, clock=lambda: now[0])
    seen = []
    sup.on_presence = lambda rank, attempt, present, reason, rerun=None: seen.append((rank, attempt, present, reason))
    sup.start()
    sup.tick()  # every rank reads running
    return sup, ex, record, now, seen


def events(record, *kinds):
    return [e for e in record.events() if e["event"] in kinds]


def test_a_replica_cancelled_outside_diloco_is_relaunched_and_the_others_are_untouched():
    sup, ex, record, now, seen = supervised()
    ex.now[(1, 0)] = CANCELLED
    assert sup.tick() is not RunState.STOPPED
    sup.tick()  # the relaunch, due at once (backoff 0)
    assert [st.handle.attempt for st in sup.ranks] == [0, 1] and ex.cancelled == []
    (cancelled,) = events(record, "cancelled_outside")
    assert (cancelled["rank"], cancelled["attempt"], cancelled["detail"]) == (1, 0, "cancelled by uid 1000 (scancel)")
    assert [st.restarts for st in sup.ranks] == [0, 1]  # the rank's loss: its failure budget pays
    assert not events(record, "run_cancelled", "cancelled")
    ex.now.update({(0, 0): DONE, (1, 1): DONE})
    assert sup.tick() is RunState.SUCCEEDED
    assert seen == [(0, 0, True, "running"), (1, 0, True, "running"), (1, 0, False, "cancelled_outside"),
                    (1, 1, True, "running"), (0, 0, False, "succeeded"), (1, 1, False, "succeeded")]


def test_diloco_cancel_still_ends_the_run():
    sup, ex, record, now, seen = supervised()
    record.request_cancel()
    ex.now[(1, 0)] = CANCELLED
    assert sup.tick() is RunState.STOPPED
    assert ex.cancelled == [(0, 0)] and not events(record, "cancelled_outside", "relaunch_scheduled")
    assert [e.get("by") for e in events(record, "run_cancelled")] == ["diloco cancel"]
    assert record.stopped_because is None


@pytest.mark.parametrize("apart, stops", [(0.0, True), (ALL_CANCELLED_WINDOW, True), (ALL_CANCELLED_WINDOW + 1, False)])
def test_every_replica_cancelled_outside_within_the_window_stops_the_run_and_says_why(apart, stops):
    sup, ex, record, now, seen = supervised()
    ex.now[(0, 0)] = CANCELLED
    sup.tick()
    sup.tick()  # rank 0 relaunched: attempt 1 runs
    assert sup.ranks[0].handle.attempt == 1
    now[0] += apart
    ex.now[(1, 0)] = CANCELLED
    state = sup.tick()
    assert (state is RunState.STOPPED) is stops
    if stops:
        assert ex.cancelled == [(0, 1)]  # rank 0's new attempt stopped with the rest
        assert "every replica of the run was cancelled outside diloco within 60s" in record.stopped_because
        (stop,) = events(record, "run_cancelled")
        assert stop["by"] == "outside diloco" and stop["reason"] == record.stopped_because
    else:
        sup.tick()
        assert [st.handle.attempt for st in sup.ranks] == [1, 1] and not events(record, "run_cancelled")


def test_a_time_limit_relaunches_at_once_without_spending_the_restart_budget():
    sup, ex, record, now, seen = supervised({"max_restarts": 0, "max_restarts_per_rank": 0, "backoff": 30})
    ex.now[(1, 0)] = TIMED_OUT
    sup.tick()  # relaunched in the same pass: no backoff for a time limit
    assert [st.handle.attempt for st in sup.ranks] == [0, 1]
    assert [(st.restarts, st.time_limits) for st in sup.ranks] == [(0, 0), (0, 1)] and sup.restarts_used == 0
    (timed,) = events(record, "time_limit")
    assert timed["rank"] == 1 and "time limit" in timed["error"] and not events(record, "failed")
    assert [e.get("reason") for e in events(record, "relaunch_scheduled")] == ["time_limit"]
    assert (1, 0, False, "time_limit") in seen


def test_a_time_limit_under_the_gang_policy_restarts_everyone_without_spending_the_run_budget():
    sup, ex, record, now, seen = supervised({"policy": "gang", "max_restarts": 0})
    ex.now[(0, 0)] = TIMED_OUT
    sup.tick()
    sup.tick()
    assert [st.handle.attempt for st in sup.ranks] == [1, 1] and sup.restarts_used == 0
    assert [st.time_limits for st in sup.ranks] == [1, 0] and ex.cancelled == [(1, 0)]
    assert {(r, p, why) for r, _, p, why in seen if not p} == {(0, False, "gang_restart"), (1, False, "gang_restart")}


def test_max_time_limits_per_rank_gives_the_rank_up():
    sup, ex, record, now, seen = supervised({"max_time_limits_per_rank": 1, "min_replicas": 1})
    ex.now[(1, 0)] = TIMED_OUT
    sup.tick()
    ex.now[(1, 1)] = TIMED_OUT
    sup.tick()
    assert sup.ranks[1].given_up and seen[-1] == (1, 1, False, "given_up")
    assert events(record, "give_up")[0]["reason"] == "max_time_limits_per_rank (1) reached"


# -- the same through real local processes and the CLI -----------------------------------------

HOLD = '''
import os, time
from pathlib import Path

def main(ctx, marker_dir: str, hold: list = (), until: str = "", seconds: float = 60.0):
    """Marks its start; an attempt named in `hold` ("rank.attempt") sleeps `seconds` (to be stopped);
    every attempt then waits until the marker `until` exists (at most `seconds`)."""
    marker = Path(marker_dir, f"{ctx.rank}.{ctx.attempt}.pid")
    Path(f"{marker}.tmp").write_text(str(os.getpid()))
    os.replace(f"{marker}.tmp", marker)
    if f"{ctx.rank}.{ctx.attempt}" in hold:
        time.sleep(seconds)
    deadline = time.monotonic() + seconds
    while until and not Path(marker_dir, until).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return {"rank": ctx.rank, "attempt": ctx.attempt}
'''


def _spec(project, top: str, args: str, restart: str = ""):
    return marker_spec(project, "hold", HOLD, replicas=2, args=args, restart=restart, top=top)


_record = status_json


def test_a_replica_past_the_specs_timeout_is_relaunched_without_spending_restarts(cli, project):
    spec, markers = _spec(project, "timeout = 5", 'hold = ["1.0"]', "max_restarts_per_rank = 0\nmax_restarts = 0")
    proc = cli("run", str(spec), check_rc=0)
    data = _record(cli, proc.stdout.split()[1].rstrip(":"))
    ranks = data["record"]["ranks"]
    assert [(r["restarts"], r["time_limits"]) for r in ranks] == [(0, 0), (0, 1)]
    assert ranks[1]["result"] == {"rank": 1, "attempt": 1} and ranks[0]["result"] == {"rank": 0, "attempt": 0}
    (timed,) = [e for e in data["events"] if e["event"] == "time_limit"]
    assert timed["rank"] == 1 and timed["error"].startswith("time limit: replica timed out after 5s"), timed
    assert not [e for e in data["events"] if e["event"] in ("failed", "give_up")]


def _launch(project, state_dir, spec):
    launcher = subprocess.Popen([sys.executable, "-m", "diloco", "run", str(spec)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "DILOCO_STATE_DIR": str(state_dir)})
    return launcher, launcher.stdout.readline().split()[1].rstrip(":")


def _cancel_outside(state_dir, run_id, rank):
    """What an admin's kill through the backend does: the rank's current attempt cancelled, no `diloco cancel`."""
    from diloco.local.executor import LocalProcessExecutor
    from diloco.runrecord.rankstate import RankState

    data = json.loads((state_dir / "runs" / run_id / "run.json").read_text())
    LocalProcessExecutor().cancel(RankState.from_dict(data["ranks"][rank]).handle)


def test_a_local_replica_cancelled_outside_diloco_is_relaunched_and_the_run_succeeds(cli, project, state_dir):
    spec, markers = _spec(project, "", 'hold = ["1.0"]\nuntil = "1.1.pid"')  # rank 0 waits for rank 1's return
    launcher, run_id = _launch(project, state_dir, spec)
    try:
        assert wait_until(lambda: {"0.0.pid", "1.0.pid"} <= {p.name for p in markers.glob("*.pid")}, timeout=60)
        _cancel_outside(state_dir, run_id, 1)
        out, _ = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, out
    data = _record(cli, run_id)
    ranks = data["record"]["ranks"]
    assert data["record"]["state"] == "SUCCEEDED" and [len(r["attempts"]) for r in ranks] == [1, 2]
    assert [r["restarts"] for r in ranks] == [0, 1]
    assert [(e["rank"], e["attempt"]) for e in data["events"] if e["event"] == "cancelled_outside"] == [(1, 0)]
    assert not [e for e in data["events"] if e["event"] in ("run_cancelled", "cancelled")]


def test_every_local_replica_cancelled_outside_diloco_stops_the_run_and_says_why(cli, project, state_dir):
    spec, markers = _spec(project, "", 'hold = ["0.0", "1.0", "0.1", "1.1"]')
    launcher, run_id = _launch(project, state_dir, spec)
    try:
        assert wait_until(lambda: {"0.0.pid", "1.0.pid"} <= {p.name for p in markers.glob("*.pid")}, timeout=60)
        for rank in (0, 1):
            _cancel_outside(state_dir, run_id, rank)
        out, _ = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
    data = _record(cli, run_id)
    assert launcher.returncode == 1 and "was cancelled: every replica of the run was cancelled outside diloco" in out, (
        out, [(e["event"], e.get("rank"), e.get("attempt")) for e in data["events"]])
    assert data["record"]["state"] == "STOPPED"
    assert sorted(e["rank"] for e in data["events"] if e["event"] == "cancelled_outside") == [0, 1]
    assert "stopped: every replica" in cli("status", run_id).stdout
