"""A replica's result as its last log line: what the runner prints, and how a launcher reads it.

A backend that has no result file to read (a container's logs are all that outlives it) gets the
entrypoint's return value from the replica's log: the runner prints it last, JSON on one line
after `RESULT_PREFIX`, and `result_from_log` finds it in the log's tail. It arrives from outside
the launcher like any other input: parsed as JSON, never unpickled, and anything malformed is no
result.
"""

from __future__ import annotations

import json

RESULT_PREFIX = "diloco: replica result: "


def result_from_log(tail: str) -> object:
    """The entrypoint's return value a replica without a result file printed last (JSON, never pickle)."""
    for line in reversed(tail.splitlines()):
        if line.startswith(RESULT_PREFIX):
            try:
                return json.loads(line[len(RESULT_PREFIX):]).get("result")
            except (ValueError, AttributeError):
                return None
    return None
