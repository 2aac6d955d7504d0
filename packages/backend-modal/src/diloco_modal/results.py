"""Reading how a replica ended on Modal: a call's status, log text, and the cause line of a failure.

Function calls are read through `get_call_graph()` (status only) and their logs, never `get()`:
that would unpickle whatever the remote side returned, and nothing diloco reads from a network
is unpickled. A failure's error starts with its cause (the rule in `diloco.failures`), then the
dashboard URL, then the last lines of output.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from diloco.failures import cause_from_log, signal_cause
from diloco.protocol import ReplicaStatus


def call_status(graph: list[Any], call_id: str) -> ReplicaStatus:
    """A function call's status from its call graph (status only: no result is fetched)."""
    mine = [i for i in graph if getattr(i, "function_call_id", None) == call_id] or list(graph)
    if not mine:  # Modal keeps inputs for a limited time: the call's record is gone
        return ReplicaStatus.FAILED
    info = mine[0]
    name = getattr(info.status, "name", str(info.status))
    if name == "PENDING":
        return ReplicaStatus.RUNNING if info.task_id else ReplicaStatus.PENDING
    return {"SUCCESS": ReplicaStatus.SUCCEEDED, "TERMINATED": ReplicaStatus.CANCELLED}.get(name, ReplicaStatus.FAILED)


def log_text(entries: Iterable[Any], n_lines: int) -> str:
    """The last `n_lines` lines of Modal log entries (`modal.types.LogEntry`), '' if none."""
    text = "".join(e.message if e.message.endswith("\n") else e.message + "\n" for e in entries)
    lines = text.splitlines()[-n_lines:]
    return "\n".join(lines) + "\n" if lines else ""


def exit_code_in(tail: str) -> int | None:
    """run_replica's failure ends "(exit code N)"; the call's logs carry it."""
    found = re.findall(r"\(exit code (-?\d+)\)", tail)
    return int(found[-1]) if found else None


def exit_cause(code: int | None, object_id: str) -> str:
    """The cause first (the rule in `diloco.failures`) when the replica printed none."""
    if code == 124:
        return f"{object_id} timed out (exit code 124)"
    killed = signal_cause(code)
    if killed:
        return killed
    return f"{object_id} exited with code {code}" if code is not None else f"{object_id} failed"


def failure_error(tail: str, code: int | None, object_id: str, url: str) -> str:
    """A failed replica's error: its cause line, where to look, and its last output."""
    first = cause_from_log(tail) or exit_cause(code, object_id)
    return f"{first}\n{url}\n{tail}".rstrip()
