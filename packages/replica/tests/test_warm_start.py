"""Replicas forked from a warm template (`diloco.local.warmstart`) are what fresh ones would be: their
own process group, rank, environment, directory, argv, random streams, log and exit status;
the template is reused by a launch's replicas and relaunches, a template that cannot come up
costs nothing but the warm start, and replicas outlive the template as they outlive a launcher."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from diloco.local import warmstart
from diloco.local.executor import LocalProcessExecutor
from diloco.testing import launch, request_for, wait_for_status

HERE = Path(__file__).parent
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="replicas are forked from a template on Linux only")


@pytest.fixture
def executor(tmp_path):
    ex = LocalProcessExecutor(grace_period=1, state_dir=str(tmp_path / "state"))
    yield ex
    ex.close()


def test_forked_replicas_are_what_fresh_ones_would_be(executor, tmp_path):
    mark = str(tmp_path / "ended")
    handles = launch(executor, 3, "warm_jobs:whoami", {"mark": mark}, run_id="warm-a", workdir=str(HERE),
                     timeout=120)
    assert [h.metadata["forked"] for h in handles] == [True, True, True]
    results = executor.collect(handles, timeout=120)
    got = [r.result for r in results]
    assert [r.status for r in results] == ["succeeded"] * 3, [r.error for r in results]
    assert [g["rank"] for g in got] == ["0", "1", "2"]
    assert all(g["pid"] == g["pgid"] == h.metadata["pid"] for g, h in zip(got, handles))  # cancel kills its group
    assert len({g["ppid"] for g in got}) == 1 and got[0]["ppid"] != os.getpid()  # one template, not the launcher
    assert all(g["torch_loaded"] and g["stdin"] == "" and g["cwd"] == str(HERE) for g in got)
    assert all(g["argv0"].endswith(os.path.join("diloco", "bootstrap", "runner.py")) for g in got)
    assert len({g["numpy"] for g in got}) == 3 and len({g["random"] for g in got}) == 3  # streams of their own
    deadline = time.monotonic() + 30
    while not all(warmstart.read_returncode(h.metadata["stem"]) == 0 for h in handles):
        assert time.monotonic() < deadline, "the forked replicas did not exit"
        time.sleep(0.02)
    for rank in range(3):  # they ended as an exit would: threads joined, then the atexit handlers
        assert os.path.exists(f"{mark}-{rank}.thread") and os.path.exists(f"{mark}-{rank}.atexit"), rank
    # a relaunch of one rank forks from the same template; exit statuses reach the launcher as a child's would
    again = launch(executor, 3, "warm_jobs:whoami", {"code": 3}, run_id="warm-a", workdir=str(HERE), timeout=120,
                   ranks=(1, 2), attempt=1)
    r1, r2 = executor.collect(again, timeout=120)
    assert r1.status == "failed" and r1.exit_code == 3 and "exited with code 3" in r1.error
    assert r2.status == "failed" and r2.exit_code == -9 and r2.error.startswith("killed by SIGKILL"), r2.error
    assert all(h.metadata["forked"] for h in again)


def test_what_the_launcher_sets_after_its_first_launch_neither_reaches_a_relaunch_nor_warms_a_template(
        executor, monkeypatch):
    """tensorboardX, imported by the launcher when the first round reaches the metric sink, sets
    CRC32C_SW_MODE in the launcher's environment. A relaunch still sees attempt 0's environment and
    forks from attempt 0's template: warming another held each relaunch of the main job ~5.6 s."""
    monkeypatch.delenv("CRC32C_SW_MODE", raising=False)
    (first,) = launch(executor, 1, "warm_jobs:whoami", run_id="warm-env", workdir=str(HERE), timeout=120)
    (r0,) = executor.collect([first], timeout=120)
    monkeypatch.setenv("CRC32C_SW_MODE", "auto")
    (again,) = launch(executor, 1, "warm_jobs:whoami", run_id="warm-env", workdir=str(HERE), timeout=120, attempt=1)
    (r1,) = executor.collect([again], timeout=120)
    assert [r0.status, r1.status] == ["succeeded", "succeeded"], [r0.error, r1.error]
    assert first.metadata["forked"] and again.metadata["forked"]
    assert r0.result["ppid"] == r1.result["ppid"]  # the same template
    assert r1.result["crc32c_sw_mode"] is None


def test_cancel_stops_a_forked_replica_and_replicas_outlive_their_template(executor):
    handles = launch(executor, 2, "warm_jobs:whoami", {"sleep_s": 600}, run_id="warm-b", workdir=str(HERE),
                     timeout=900)
    assert all(h.metadata["forked"] for h in handles)
    assert wait_for_status(executor, handles[0], {"running"}) == "running"
    executor.close()  # the launcher's end: its templates go, the replicas it started do not
    assert executor.poll(handles[1]).value == "running"
    executor.cancel(handles[0])
    assert executor.poll(handles[0]).value == "cancelled"
    pgid = handles[1].metadata["pid"]
    os.killpg(pgid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while executor.poll(handles[1]).value == "running" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert executor.poll(handles[1]).value == "failed"


def test_a_template_that_cannot_come_up_leaves_replicas_to_start_fresh(executor, tmp_path):
    # a workdir whose diloco_replica.py shadows the runtime: the template's preload fails
    (tmp_path / "diloco_replica.py").write_text("")
    (tmp_path / "job.py").write_text("import os\ndef pid():\n    return os.getpid()\n")
    handles = launch(executor, 2, "job:pid", {}, run_id="warm-c", workdir=str(tmp_path), timeout=120)
    assert [h.metadata["forked"] for h in handles] == [False, False]
    assert [r.status for r in executor.collect(handles, timeout=120)] == ["succeeded"] * 2


def test_off_it_starts_each_replica_fresh(tmp_path):
    ex = LocalProcessExecutor(warm_start=False, state_dir=str(tmp_path / "state"))
    plan = ex.plan(request_for(1, "warm_jobs:whoami", {}, run_id="warm-d", workdir=str(HERE)))
    assert [row["warm"] for row in plan.body["processes"]] == [False]
    [handle] = ex.submit(plan)
    assert handle.metadata["forked"] is False
    [result] = ex.collect([handle], timeout=120)
    assert result.status == "succeeded" and result.result["ppid"] == os.getpid()


def test_nothing_the_template_imports_reads_a_per_replica_variable():
    """What a template imports must not read a variable that differs between replicas (it would
    keep the template's value): every read of one variable of os.environ during the preload is
    recorded (a copy of the whole environment, as tqdm's import makes, reads none in particular)."""
    probe = textwrap.dedent("""
        import inspect, os
        read = []
        class Watched(type(os.environ)):
            def __getitem__(self, key):
                caller = inspect.currentframe().f_back.f_code
                if not (caller.co_name == "__iter__" and "_collections_abc" in caller.co_filename):
                    read.append(key)
                return super().__getitem__(key)
        os.environ.__class__ = Watched
        from diloco.local import warmstart
        import diloco_replica.preload
        bad = [k for k in read if k in warmstart.PER_REPLICA or k.startswith(warmstart.PER_REPLICA_PREFIX)]
        print(bad)
    """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "REPLICA_RANK": "0", "DILOCO_RUN_ID": "x"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
