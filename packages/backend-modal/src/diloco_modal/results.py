"""Reading how a replica ended on Modal: the exit code and the cause line of a failure.

A failure's error starts with its cause (the rule in `diloco.bootstrap.failures`), then the dashboard URL,
then the last lines of output (`logtail`). A call's status is read in `calls`, never by `get()`,
and its exit code from its output record, never from its output's text.
"""

from __future__ import annotations

import re

from diloco.bootstrap.failures import cause, cause_from_log, signal_cause


_REPLICA_FAILED = re.compile(r"ReplicaFailed\((['\"])(?P<message>.*?) ?\(exit code (?P<code>-?\d{1,3})\)\1\)",
                             re.DOTALL)


def replica_exit_code(exception: str) -> int | None:
    """The replica's exit code, from a failed call's output record: Modal keeps the exception the
    function raised as its repr, and run_replica's `ReplicaFailed` ends "(exit code N)". Nothing
    else counts: the call's log text is the user's own output ("(exit code 78)" in a line of it
    is not how the call ended), and so is any other exception."""
    found = _REPLICA_FAILED.fullmatch(exception or "")
    return int(found.group("code")) if found else None


def replica_message(exception: str) -> str:
    """What run_replica's `ReplicaFailed` says happened (its cause, before "(exit code N)"), or ''."""
    found = _REPLICA_FAILED.fullmatch(exception or "")
    return cause(found.group("message")) if found else ""


def exit_cause(code: int | None, object_id: str, said: str = "") -> str:
    """The cause first (the rule in `diloco.bootstrap.failures`) when the replica printed none;
    `said`: how Modal's output record says a call failed (a clustered call that lost a container
    says which), the cause where no exit code is known."""
    if code == 124:
        return f"{object_id} timed out (exit code 124)"
    killed = signal_cause(code)
    if killed:
        return killed
    if code is not None:  # run_replica's own words when its log did not carry them (a cluster's, racing)
        message = replica_message(said)
        return f"{object_id} failed: {message}" if message else f"{object_id} exited with code {code}"
    return f"{object_id} failed: {cause(said)}" if cause(said) else f"{object_id} failed"


def failure_error(tail: str, code: int | None, object_id: str, url: str, said: str = "") -> str:
    """A failed replica's error: its cause line, where to look, and its last output."""
    first = cause_from_log(tail) or exit_cause(code, object_id, said)
    return f"{first}\n{url}\n{tail}".rstrip()
