"""Supervision with real processes: relaunch policies, budgets, and a launcher that dies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from diloco.testing import process_alive

from conftest import marker_spec, status_json, wait_until, write_spec

FLAKY = '''
import os, sys, time
from pathlib import Path

def main(ctx, fail_rank: int = 1, fail_attempts: int = 1, work: float = 0.3, marker_dir: str = ""):
    """Rank `fail_rank` fails on its first `fail_attempts` attempts; every rank works a little."""
    marker = Path(marker_dir, f"{ctx.rank}.{ctx.attempt}.pid")
    Path(f"{marker}.tmp").write_text(str(os.getpid()))
    os.replace(f"{marker}.tmp", marker)  # whole when it appears: tests read it as soon as it is there
    time.sleep(work)
    if ctx.rank == fail_rank and ctx.attempt < fail_attempts:
        raise RuntimeError(f"flaky failure on rank {ctx.rank} attempt {ctx.attempt}")
    return {"rank": ctx.rank, "attempt": ctx.attempt}
'''


def _spec(project, restart: str, args: str, replicas: int = 3):
    return marker_spec(project, "flaky", FLAKY, replicas=replicas, args=args, restart=restart)


_record = status_json


def test_per_rank_relaunch_replaces_only_the_failed_rank(cli, project):
    spec, markers = _spec(project, "", "fail_attempts = 2")
    proc = cli("run", str(spec), check_rc=0)
    run_id = proc.stdout.split()[1].rstrip(":")
    started = sorted(p.name for p in markers.glob("*.pid"))
    assert started == ["0.0.pid", "1.0.pid", "1.1.pid", "1.2.pid", "2.0.pid"]  # ranks 0, 2 never restarted
    data = _record(cli, run_id)
    ranks = data["record"]["ranks"]
    assert [r["restarts"] for r in ranks] == [0, 2, 0]
    assert ranks[1]["result"] == {"rank": 1, "attempt": 2}
    kinds = [e["event"] for e in data["events"]]
    assert kinds.count("relaunch_scheduled") == 2 and kinds[-1] == "run_succeeded"
    failed = [e for e in data["events"] if e["event"] == "failed"]
    assert "flaky failure on rank 1 attempt 0" in failed[0]["error"]


def test_restarts_exhausted_stops_everything_and_lists_each_rank_error(cli, project):
    spec, markers = _spec(project, "max_restarts_per_rank = 2", "fail_attempts = 99\nwork = 0.2")
    proc = cli("run", str(spec))
    assert proc.returncode == 1
    assert "rank 1: RuntimeError: flaky failure on rank 1 attempt 2" in proc.stdout
    run_id = proc.stdout.split()[1].rstrip(":")
    data = _record(cli, run_id)
    assert data["record"]["state"] == "FAILED"
    assert "below min_replicas=3" in data["record"]["failure"]
    assert any(e["event"] == "give_up" and e["rank"] == 1 for e in data["events"])
    pids = [int(p.read_text()) for p in markers.glob("*.pid")]
    assert wait_until(lambda: not any(process_alive(p) for p in pids), timeout=10)


def test_min_replicas_lets_the_survivors_finish(cli, project):
    spec, markers = _spec(project, "max_restarts_per_rank = 1\nmin_replicas = 2", "fail_attempts = 99")
    proc = cli("run", str(spec), check_rc=0)
    data = _record(cli, proc.stdout.split()[1].rstrip(":"))
    assert [r["status"] for r in data["record"]["ranks"]] == ["succeeded", "failed", "succeeded"]
    assert data["record"]["ranks"][1]["given_up"] is True


def test_gang_policy_relaunches_every_rank(cli, project):
    spec, markers = _spec(project, 'policy = "gang"', "fail_attempts = 1\nwork = 1.0")
    proc = cli("run", str(spec), check_rc=0)
    data = _record(cli, proc.stdout.split()[1].rstrip(":"))
    assert {p.name for p in markers.glob("*.pid")} >= {"0.1.pid", "1.1.pid", "2.1.pid"}
    assert data["record"]["restarts_used"] == 1
    assert any(e["event"] == "gang_restart" for e in data["events"])


def test_launcher_killed_then_resumed_finishes_the_run(cli, project, state_dir):
    spec, markers = _spec(project, "", "fail_attempts = 1\nwork = 4.0")
    launcher = subprocess.Popen([sys.executable, "-m", "diloco", "run", str(spec)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "DILOCO_STATE_DIR": str(state_dir)})
    run_id = launcher.stdout.readline().split()[1].rstrip(":")
    deadline = time.monotonic() + 30
    while len(list(markers.glob("*.pid"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    status = cli("status", run_id, check_rc=0).stdout
    assert "no launcher is supervising this run: diloco resume" in status
    run_json = state_dir / "runs" / run_id / "run.json"
    recorded = run_json.read_text()
    data = json.loads(recorded)
    assert data["launch"]["diloco_version"].startswith("diloco-core==")
    data["launch"]["diloco_version"] = "diloco-core==0.0.1"
    run_json.write_text(json.dumps(data))
    refused = cli("resume", run_id)  # another diloco would relaunch replicas unlike the others
    assert refused.returncode == 2 and "launched with diloco-core==0.0.1 but this shell has" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    run_json.write_text(recorded)
    resumed = cli("resume", run_id, check_rc=0)
    assert "SUCCEEDED" in resumed.stdout
    data = _record(cli, run_id)
    assert [r["status"] for r in data["record"]["ranks"]] == ["succeeded"] * 3
    assert data["record"]["ranks"][1]["result"]["attempt"] == 1  # the failure during the outage was handled
    assert any(e["event"] == "resumed" for e in data["events"])
    again = cli("resume", run_id)
    assert again.returncode == 2 and "already ended" in again.stderr


def test_backend_without_rank_relaunch_is_supervised_as_a_gang(tmp_path):
    from diloco.local.executor import LocalProcessExecutor
    from diloco.runrecord.state import RunRecord
    from diloco.protocol import Capabilities
    from diloco.request import LaunchRequest
    from diloco.supervise.supervisor import Supervisor

    class NoRelaunch(LocalProcessExecutor):
        capabilities = Capabilities(shares_launcher_filesystem=True)

    request = LaunchRequest(run_id="gang-fallback", n_replicas=2, entrypoint="x:y", timeout=60)
    sup = Supervisor(NoRelaunch(), RunRecord.create("gang-fallback", {}), request, {"policy": "per-rank"})
    assert sup.policy == "gang"


@pytest.mark.parametrize("choice", ["detach", "cancel"])
def test_ctrl_c_detaches_or_cancels_as_asked(cli, project, state_dir, choice):
    spec, markers = _spec(project, "", "fail_attempts = 0\nwork = 30")
    launcher = subprocess.Popen([sys.executable, "-m", "diloco", "run", str(spec), "--on-interrupt", choice],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "DILOCO_STATE_DIR": str(state_dir)})
    run_id = launcher.stdout.readline().split()[1].rstrip(":")
    deadline = time.monotonic() + 30
    while len(list(markers.glob("*.pid"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = [int(p.read_text()) for p in markers.glob("*.pid")]
    launcher.send_signal(signal.SIGINT)
    out, _ = launcher.communicate(timeout=30)
    assert launcher.returncode == 130
    if choice == "detach":
        assert f"diloco resume {run_id}" in out and all(process_alive(p) for p in pids)
        cli("cancel", run_id, check_rc=0)
    else:
        assert wait_until(lambda: not any(process_alive(p) for p in pids), timeout=10)
        assert _record(cli, run_id)["record"]["state"] == "STOPPED"


def test_logs_follow_streams_until_the_replica_ends(cli, project, state_dir):
    (project / "talk.py").write_text("import time\ndef main(ctx):\n    for i in range(6):\n"
                                     "        print(f'line {i}', flush=True)\n        time.sleep(0.3)\n")
    spec = write_spec(project, 'backend = "local"\nreplicas = 1\nentrypoint = "talk:main"\n', name="talk.toml")
    launcher = subprocess.Popen([sys.executable, "-m", "diloco", "run", str(spec)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True,
                                env=dict(os.environ))
    run_id = launcher.stdout.readline().split()[1].rstrip(":")
    record = state_dir / "runs" / run_id / "run.json"
    assert wait_until(lambda: record.exists() and json.loads(record.read_text()).get("ranks", [{}])[0].get("handle"))
    follow = cli("logs", run_id, "--rank", "0", "--follow", check_rc=0)
    assert follow.stdout.splitlines() == [f"line {i}" for i in range(6)]
    launcher.wait(timeout=30)


def test_a_quiet_run_keeps_its_heartbeat_fresh(cli, project, state_dir):
    """Nothing changes for seconds, yet other shells must still see a live launcher (no double resume)."""
    spec, markers = _spec(project, "", "fail_attempts = 0\nwork = 9", replicas=1)
    launcher = subprocess.Popen([sys.executable, "-m", "diloco", "run", str(spec)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
    try:
        run_id = launcher.stdout.readline().split()[1].rstrip(":")
        record = state_dir / "runs" / run_id / "run.json"

        def beat() -> float:
            return json.loads(record.read_text())["launcher"]["heartbeat"]

        assert wait_until(lambda: record.exists() and "running" in record.read_text())
        first = beat()  # from here nothing changes but the heartbeat (the replica works for 9 s)
        assert wait_until(lambda: beat() > first, timeout=8), "no heartbeat while the run was quiet"
        refused = cli("resume", run_id)
        assert refused.returncode == 2 and "supervised by process" in refused.stderr
    finally:
        launcher.wait(timeout=30)


PREEMPTED = '''
import os, signal, time

def main(ctx, preempt_attempts: int = 2):
    """Rank 1's platform preempts it (its notice signal) on its first `preempt_attempts` attempts."""
    if ctx.rank == 1 and ctx.attempt < preempt_attempts:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)
    return {"rank": ctx.rank, "attempt": ctx.attempt}
'''


@pytest.mark.parametrize("max_preemptions", [5, 1])
def test_a_preempted_replica_is_relaunched_without_spending_the_restart_budget(cli, project, max_preemptions):
    """Exit 75 (the runner's answer to the platform's preemption notice) is not a failure: a budget
    of zero code-failure restarts still lets the preempted rank come back, up to max_preemptions."""
    (project / "preempted.py").write_text(PREEMPTED)
    spec = write_spec(project, 'backend = "local"\nreplicas = 3\nentrypoint = "preempted:main"\n'
                               '[env]\nDILOCO_PREEMPTION_SIGNAL = "SIGINT"\n'
                               f'[restart]\nmonitor_interval = 0.05\nbackoff = 0.05\nmax_restarts_per_rank = 0\n'
                               f'max_preemptions = {max_preemptions}\nmin_replicas = 2\n')
    proc = cli("run", str(spec), check_rc=0)
    data = _record(cli, proc.stdout.split()[1].rstrip(":"))
    ranks = data["record"]["ranks"]
    preempted = [e for e in data["events"] if e["event"] == "preempted"]
    assert all(e["rank"] == 1 and "preempted: the platform sent SIGINT" in e["error"] for e in preempted)
    assert not [e for e in data["events"] if e["event"] == "failed"]
    assert [r["restarts"] for r in ranks] == [0, 0, 0]
    if max_preemptions == 5:
        assert len(preempted) == 2 and ranks[1]["preemptions"] == 2 and ranks[1]["status"] == "succeeded"
        assert ranks[1]["result"] == {"rank": 1, "attempt": 2}
    else:
        assert ranks[1]["preemptions"] == 1 and ranks[1]["given_up"]
        assert any(e["event"] == "give_up" and "max_preemptions (1) reached" in e["reason"] for e in data["events"])


def test_a_replica_the_platform_retries_itself_is_pending_not_failed(tmp_path):
    """SageMaker keeps a spot-interrupted job InProgress and restarts it: the replica reads running →
    pending → running. The supervisor records why (the executor's optional `status_detail`), and
    neither relaunches it nor spends a restart."""
    from diloco.local.executor import LocalProcessExecutor
    from diloco.protocol import ReplicaStatus
    from diloco.runrecord.state import RunRecord
    from diloco.protocol import Capabilities
    from diloco.request import LaunchRequest
    from diloco.supervise.policy import RunState
    from diloco.supervise.supervisor import Supervisor

    class SpotLike(LocalProcessExecutor):
        capabilities = Capabilities(shares_launcher_filesystem=True, relaunches_one_rank=True, status_detail=True)
        polls_pending = 0

        def poll(self, handle):
            status = super().poll(handle)
            if handle.rank == 0 and status is ReplicaStatus.RUNNING and self.polls_pending < 5:
                self.seen_running = getattr(self, "seen_running", 0) + 1
                if self.seen_running > 1:  # after it was seen running once: interrupted for 5 polls
                    self.polls_pending += 1
                    return ReplicaStatus.PENDING
            return status

        def status_detail(self, handle):
            return "Interrupted: spot capacity was reclaimed (spot interruptions so far: 1)"

    args = LaunchRequest(run_id="spot-like", n_replicas=2, entrypoint="diloco.testing.entrypoints:sleep",
                         args={"seconds": 2.0}, timeout=60)
    record = RunRecord.create("spot-like", {})
    sup = Supervisor(SpotLike(), record, args, {"policy": "per-rank", "monitor_interval": 0.05, "max_restarts": 0})
    assert sup.run() is RunState.SUCCEEDED
    events = [json.loads(x) for x in (record.dir / "events.jsonl").read_text().splitlines()]
    pending = [e for e in events if e["event"] == "pending"]
    assert [(e["rank"], e["reason"]) for e in pending] == [
        (0, "Interrupted: spot capacity was reclaimed (spot interruptions so far: 1)")]
    kinds = [e["event"] for e in events]
    assert "failed" not in kinds and "relaunch_scheduled" not in kinds
    assert [r.restarts for r in sup.ranks] == [0, 0] and kinds.count("running") == 3


class _ThrottledControlPlane:
    """An executor whose control plane answers nothing for `outage` seconds of the supervisor's
    clock (ThrottlingException past the SDK's retries), then reports every replica succeeded."""

    backend_name = "throttled"

    def __init__(self, clock, outage: float):
        from diloco.protocol import Capabilities

        self.capabilities = Capabilities(shares_launcher_filesystem=False)
        self.clock, self.until = clock, clock() + outage

    def plan(self, request):
        from diloco.request import LaunchPlan

        return LaunchPlan(self.backend_name, request, {"ranks": list(request.ranks)})

    def submit(self, plan):
        from diloco.protocol import ReplicaHandle

        return [ReplicaHandle(r, self.backend_name, {"id": r}) for r in plan.request.ranks]

    def poll(self, handle):
        from diloco.errors import BackendError
        from diloco.protocol import ReplicaStatus

        if self.clock() < self.until:
            raise BackendError("SageMaker failed to describe the job: ThrottlingException: Rate exceeded")
        return ReplicaStatus.SUCCEEDED

    def collect(self, handles, *, timeout=None):
        from diloco.protocol import ReplicaResult, ReplicaStatus

        return [ReplicaResult(h.rank, ReplicaStatus.SUCCEEDED, 0) for h in handles]

    def stream_logs(self, handle, *, n_lines=200):
        return ""

    def cancel(self, handle):
        pass


@pytest.mark.parametrize("outage, survives", [(300.0, True), (1200.0, False)])
def test_a_control_plane_that_cannot_answer_for_a_while_does_not_stop_the_launcher(outage, survives):
    from diloco.errors import BackendError
    from diloco.request import LaunchRequest
    from diloco.runrecord.state import RunRecord
    from diloco.supervise.supervisor import POLL_OUTAGE_LIMIT, Supervisor

    now = [1000.0]
    clock = lambda: now[0]  # noqa: E731
    request = LaunchRequest(run_id="throttled", n_replicas=2, entrypoint="x:y", timeout=60)
    record = RunRecord.create("throttled", {})
    sup = Supervisor(_ThrottledControlPlane(clock, outage), record, request, {}, clock=clock)
    sup.start()
    try:
        while not sup.tick().is_final:
            now[0] += 30.0
    except BackendError as exc:
        assert not survives and "has not answered for" in str(exc) and "diloco resume throttled" in str(exc)
        assert now[0] - 1000.0 > POLL_OUTAGE_LIMIT
        return
    assert survives and sup.state.value == "SUCCEEDED"
    kinds = [e["event"] for e in record.events()]
    assert kinds.count("poll_failed") == 1 and "poll_recovered" in kinds
    assert not any(k in ("failed", "cancelled", "launch") for k in kinds[1:])  # nothing relaunched or cancelled


class _AnsweringControlPlane(_ThrottledControlPlane):
    """Answers every poll at once: its replica keeps running."""

    backend_name = "answering"

    def poll(self, handle):
        from diloco.protocol import ReplicaStatus

        return ReplicaStatus.RUNNING


def test_one_groups_silent_backend_is_not_hidden_by_another_that_answers():
    """A run across backends: group b's control plane never answers while group a's does. b's
    outage is timed on its own, so the launcher stops after POLL_OUTAGE_LIMIT (naming the fix)
    instead of logging poll_failed / poll_recovered every pass forever."""
    from diloco.errors import BackendError
    from diloco.launching.groupexec import GroupedExecutor
    from diloco.spec.groups import ReplicaGroup
    from diloco.request import LaunchRequest
    from diloco.runrecord.state import RunRecord
    from diloco.supervise.supervisor import POLL_OUTAGE_LIMIT, Supervisor

    now = [1000.0]
    clock = lambda: now[0]  # noqa: E731
    a = ReplicaGroup(name="a", backend="answering", replicas=1, first_rank=0, timeout=60.0)
    b = ReplicaGroup(name="b", backend="throttled", replicas=1, first_rank=1, timeout=60.0)
    executor = GroupedExecutor([(a, lambda: _AnsweringControlPlane(clock, 0)),
                                (b, lambda: _ThrottledControlPlane(clock, 10**9))])
    request = LaunchRequest(run_id="two-planes", n_replicas=2, entrypoint="x:y", timeout=60)
    record = RunRecord.create("two-planes", {"spec": {"groups": [a.to_dict(), b.to_dict()]}})
    sup = Supervisor(executor, record, request, {}, clock=clock)
    sup.start()
    with pytest.raises(BackendError, match="has not answered for"):
        for _ in range(100):
            sup.tick()
            now[0] += 30.0
    assert now[0] - 1000.0 > POLL_OUTAGE_LIMIT
    failed = [e for e in record.events() if e["event"] == "poll_failed"]
    assert [(e["rank"], e["group"]) for e in failed] == [(1, "b")]
    assert not any(e["event"] == "poll_recovered" for e in record.events())
