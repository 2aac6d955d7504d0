"""Whether a run is looked after, and how its replicas are now, read from any shell: the launcher
that supervises it (`launcher_alive`), and each rank's status as its backend reports it
(`live_statuses`), group by group in a run across backends. What `diloco status` and the Python
API's `Run.supervised()`, `Run.live()` and `Run.status()` show."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import Any

from ..runrecord.state import RunRecord


def live_statuses(record: RunRecord) -> tuple[dict[int, str], str | None]:
    """Live statuses, rank by rank, and why some are missing: in a run across backends one
    group's missing SDK or API outage leaves the other groups' statuses standing."""
    from ..launching.launcher import executor_for

    executor = executor_for(record)
    live, failed = per_group(record, lambda h: executor.poll(h).value)
    return live, ("; ".join(f"group {g}: {e}" for g, e in failed.items()) or None)


def per_group(record: RunRecord, act: Callable[[Any], Any]) -> tuple[dict[int, Any], dict[str, str]]:
    """`act(handle)` for the current handle of every rank, by rank. In a run across backends a
    group whose backend cannot be reached from this shell (its SDK or plugin missing, its API
    down) is skipped after its first error, which is returned by group name, and the other groups
    still get theirs; a one-backend run raises as before."""
    from ..errors import DilocoError

    groups = record.rank_groups
    done: dict[int, Any] = {}
    failed: dict[str, str] = {}
    for h in record.handles:
        where = groups.get(h.rank, "")
        if where in failed:
            continue
        try:
            done[h.rank] = act(h)
        except DilocoError as exc:
            if not groups:
                raise
            failed[where] = str(exc)
    return done, failed


def launcher_alive(record: RunRecord) -> bool:
    """Whether some launcher still supervises the run.

    On this host the process decides (its pid, and its start time against a recycled pid): a
    launcher paused past its heartbeat is still alive. On another host only the heartbeat can.
    """
    from ..supervise.lease import LEASE_FILE, current_holder
    from ..host.procinfo import is_running
    from ..supervise.supervisor import HEARTBEAT_STALE

    if (record.dir / LEASE_FILE).exists():  # the lease decides (records before it: the heartbeat below)
        holder = current_holder(record.dir)
        return holder is not None and not (holder.pid == os.getpid() and holder.host == socket.gethostname())
    launcher = record.launcher
    if not launcher.pid or (launcher.pid == os.getpid() and launcher.host == socket.gethostname()):
        return False
    if launcher.host == socket.gethostname():
        return is_running(int(launcher.pid), launcher.started)
    interval = float((record.data.get("spec") or {}).get("restart", {}).get("monitor_interval") or 1.0)
    return time.time() - launcher.heartbeat <= max(HEARTBEAT_STALE, 10 * interval)
