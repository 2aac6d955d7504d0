"""Whether a recorded process is still the one that was recorded.

A pid alone is not an identity: once a process ends, the system hands its pid to another. So
wherever a pid is recorded (a replica's process group, the launcher's heartbeat, a lease) its
start is recorded beside it, and a live process counts as the recorded one only if both match.
psutil reads both portably; a zombie (ended, not yet reaped) counts as gone.

The start must not move when the wall clock does. psutil's creation time on Linux is the
kernel's count of clock ticks since boot plus the boot time, and the boot time it adds is read
again at every call, from the wall clock: a step of the clock (NTP or chrony stepping a fresh
VM, a clock set by hand, a VM resumed from a snapshot) moves every process's creation time by
the step, even one of a few milliseconds that carries the boot time, whole seconds only, over to
the next second. A recorded process then looks gone: the launcher would relaunch replicas that
still train, `diloco cancel` from another shell would stop nothing, and a lease would look
free while its holder lives. So on Linux the start is seconds since boot (the ticks alone); on
macOS and the BSDs psutil's creation time is the wall time the kernel stored at the start,
which a later step does not move.
"""

from __future__ import annotations

import psutil

# Two readings of one process's start differ by float rounding at most; a recycled pid started
# within a second of the one recorded (after a reboot, at the same time since boot) is not a
# case that arises.
SAME_START_S = 1.0


def started_at(pid: int) -> float | None:
    """When `pid` was created (Linux: seconds since boot; elsewhere: seconds since the epoch, as the
    kernel stored it), or None if no live process has it; -1.0 if it is another user's."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        if not psutil.LINUX:
            return process.create_time()
        boot = psutil.boot_time()  # first: psutil 5.9 adds the boot time its last read cached
        return process.create_time() - boot
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
