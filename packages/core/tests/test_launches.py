"""Relaunches beside the supervisor's loop (`diloco.supervise.ranklauncher`, `.launches`): a slow launch never
blinds the supervisor, a relaunch starts when it falls due, and a launch still in flight when
the run ends is cancelled once it returns.

The scripted executor of test_lifecycle, on the real clock where a launch must really be slow.
"""

from __future__ import annotations

import threading

from diloco.protocol import ReplicaStatus
from diloco.request import LaunchRequest
from diloco.runrecord.state import RunRecord
from diloco.supervise.launches import BackgroundLaunches, by_attempt
from diloco.supervise.policy import RunState
from diloco.supervise.supervisor import Supervisor

from test_lifecycle import DONE, Scripted

KILLED = (ReplicaStatus.FAILED, 137, "killed by SIGKILL")


class SlowRelaunch(Scripted):
    """Submitting rank 0's relaunch blocks until the test opens `gate` (a template warming, a
    cloud API retrying)."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()
        self.submitting = threading.Event()

    def submit(self, plan):
        if plan.request.attempt > 0 and plan.request.ranks == (0,):
            self.submitting.set()
            assert self.gate.wait(60), "the test never opened the gate"
        return super().submit(plan)


def supervised(executor, n: int = 3, **restart):
    record = RunRecord.create("slow-launch", {})
    request = LaunchRequest(run_id="slow-launch", n_replicas=n, entrypoint="x:y", timeout=60)
    sup = Supervisor(executor, record, request, {"backoff": 0, "policy": "per-rank", **restart})
    sup.start()
    sup.tick()  # every rank reads running
    return sup, record


def events(record, kind):
    return [e for e in record.events() if e["event"] == kind]


def test_a_slow_relaunch_never_blinds_the_supervisor_to_the_other_ranks():
    ex = SlowRelaunch()
    sup, record = supervised(ex)
    ex.now[(0, 0)] = KILLED
    sup.tick()  # rank 0's relaunch starts, and does not return
    assert ex.submitting.is_set() and sup.launcher.in_flight() == {0}
    assert sup.ranks[0].handle.attempt == 0 and not events(record, "launch")[1:]

    ex.now[(1, 0)] = KILLED  # a second rank ends while the first one's launch hangs
    sup.tick()
    assert [e["rank"] for e in events(record, "failed")] == [0, 1]
    assert [e["rank"] for e in events(record, "relaunch_scheduled")] == [0, 1]
    saved = RunRecord.load("slow-launch")  # what another shell reads: rank 1's failure is on disk
    assert [r["status"] for r in saved.data["ranks"]][:2] == ["failed", "failed"]
    assert sup.launcher.in_flight() == {0, 1}  # rank 1's relaunch queued behind rank 0's

    ex.gate.set()
    sup.launcher.background.wait(30)
    sup.tick()
    assert [st.handle.attempt for st in sup.ranks] == [1, 1, 0]
    assert [(e["ranks"], e["attempt"]) for e in events(record, "launch")] == [([0, 1, 2], 0), ([0], 1), ([1], 1)]
    ex.now.update({(0, 1): DONE, (1, 1): DONE, (2, 0): DONE})
    assert sup.tick() is RunState.SUCCEEDED


def test_a_relaunch_in_flight_when_the_run_is_cancelled_is_cancelled_when_it_returns():
    ex = SlowRelaunch()
    sup, record = supervised(ex, n=2)
    ex.now[(0, 0)] = KILLED
    sup.tick()
    assert sup.launcher.in_flight() == {0}
    record.request_cancel()
    threading.Timer(0.3, ex.gate.set).start()
    assert sup.tick() is RunState.STOPPED
    assert sorted(ex.cancelled) == [(0, 1), (1, 0)]  # the late attempt did not outlive the run
    assert not sup.launcher.in_flight()


def test_a_relaunch_that_raises_raises_on_the_supervisors_thread():
    class Refusing(Scripted):
        def submit(self, plan):
            if plan.request.attempt > 0:
                raise RuntimeError("quota exceeded")
            return super().submit(plan)

    ex = Refusing()
    sup, record = supervised(ex, n=2)
    ex.now[(1, 0)] = KILLED
    try:
        sup.tick()
    except RuntimeError as exc:
        assert "quota exceeded" in str(exc)
    else:
        raise AssertionError("the launch's error was swallowed")


def test_the_loop_wakes_when_a_relaunch_falls_due_not_at_its_next_look(monkeypatch):
    """monitor_interval 5 s, backoff 1.5 s: the supervisor sleeps 1.5 s after seeing the failure,
    not 5, so the relaunch starts at its backoff."""
    import diloco.supervise.supervisor as supervisor_module

    now = [1000.0]
    ex = Scripted()
    record = RunRecord.create("wakes", {})
    request = LaunchRequest(run_id="wakes", n_replicas=2, entrypoint="x:y", timeout=60)
    sup = Supervisor(ex, record, request, {"backoff": 1.5, "policy": "per-rank", "monitor_interval": 5.0},
                     clock=lambda: now[0])
    slept = []

    def sleep(seconds):
        slept.append(round(seconds, 6))
        now[0] += seconds
        if len(slept) == 1:
            ex.now[(1, 0)] = KILLED
        if sup.ranks[1].handle.attempt == 1:
            ex.now.update({(0, 0): DONE, (1, 1): DONE})

    monkeypatch.setattr(supervisor_module.time, "sleep", sleep)
    assert sup.run() is RunState.SUCCEEDED
    assert slept[:3] == [5.0, 1.5, 5.0]
    assert [e["attempt"] for e in events(record, "launch")] == [0, 1]


def test_launches_are_grouped_by_attempt_lowest_first():
    assert by_attempt([3, 1, 2], {1: 2, 2: 0, 3: 2}) == [(0, [2]), (2, [3, 1])]
    launches = BackgroundLaunches(lambda ranks, attempt: [])
    assert launches.finished() == [] and launches.in_flight() == set()
    launches.start([4], 1)
    launches.wait(10)
    (done,) = launches.finished()
    assert (done[0].ranks, done[0].attempt, done[1]) == ([4], 1, [])
    launches.close()
