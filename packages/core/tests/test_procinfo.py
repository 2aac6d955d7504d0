"""A recorded process is still itself after the wall clock steps (`diloco.host.procinfo`).

psutil adds the boot time, read from the wall clock at every call, to a Linux process's
creation time, so a clock step moved every recorded process's start: the launcher took its live
replicas for gone, a cancel from another shell stopped nothing, a held lease looked free. The
step is simulated where psutil reads the boot time.
"""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest

from diloco.host.procinfo import is_running, started_at

pytestmark = pytest.mark.skipif(not psutil.LINUX, reason="the boot-time arithmetic is Linux's (/proc/stat)")


@pytest.fixture
def child():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("step", [1.0, 2.5, -3600.0, 86_400.0], ids=["btime-next-second", "ntp-step", "back-1h", "forward-1d"])
def test_a_clock_step_leaves_a_recorded_process_itself(child, monkeypatch, step):
    recorded = started_at(child)
    boot = psutil.boot_time()
    monkeypatch.setattr(psutil._psplatform, "boot_time", lambda: boot + step)  # the wall clock stepped
    assert is_running(child, recorded)
    assert not is_running(child, recorded + 5.0)  # another process with that pid is still told apart


def test_a_process_gone_or_never_there_is_not_running(child):
    recorded = started_at(child)
    assert is_running(child, recorded) and is_running(child, None)
    assert started_at(2**22 + 12345) is None and not is_running(2**22 + 12345, recorded)
