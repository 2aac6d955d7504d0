"""Reading how a replica ended on Modal: the exit code and the cause line of a failure.

A failure's error starts with its cause (the rule in `diloco.failures`), then the dashboard URL,
then the last lines of output (`logtail`). A call's status is read in `calls`, never by `get()`.
"""

from __future__ import annotations

import re

from diloco.failures import cause_from_log, signal_cause


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
