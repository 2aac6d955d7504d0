"""Whether a recorded process is still the one that was recorded.

A pid alone is not an identity: once a process ends, the system hands its pid to another. So
wherever a pid is recorded (a replica's process group, the launcher's heartbeat, a lease) its
creation time is recorded beside it, and a live process counts as the recorded one only if both
match. psutil reads both portably; a zombie (ended, not yet reaped) counts as gone.
"""

from __future__ import annotations

import psutil

# Creation times are derived from the boot time, which a clock step can move by a little; a
# recycled pid started this close to the original is not a case that arises.
SAME_START_S = 1.0


def started_at(pid: int) -> float | None:
    """When `pid` was created (seconds since the epoch), or None if no live process has it."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        return process.create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.AccessDenied:  # alive, but another user's: its start time is not ours to read
        return -1.0


def is_running(pid: int, recorded_start: float | None) -> bool:
    """Whether `pid` is alive and, where its start was recorded, the same process."""
    now = started_at(pid)
    if now is None:
        return False
    return recorded_start is None or now < 0 or abs(now - float(recorded_start)) < SAME_START_S
