"""Reading a failed replica's error, one rule everywhere: its first line is its cause.

Executors and the in-replica bootstrap write errors cause-first ("killed by SIGKILL", "OOM-killed",
"ValueError: ... (at global step 120)") with logs or a traceback after it, so events, `diloco
run` and `diloco status` show the first line, and shortening keeps the head as well as the tail.
"""

from __future__ import annotations

from ..errors import EXIT_CONFIG, EXIT_PREEMPTED, EXIT_TIME_LIMIT

STEP_MARK = " (at global step "
# what the in-replica runner prints before a failed replica's cause line, its last words, for
# backends that only have logs (`cause_from_log`); a spec or store mistake gets the second
CAUSE_PREFIX = "diloco: replica failed: "
USER_ERROR_PREFIX = "diloco: error: "


def cause(error: str | None) -> str:
    """The first non-empty line of an error ('' for none)."""
    for line in (error or "").splitlines():
        if line.strip():
            return line.strip()
    return ""


def is_config_error(exit_code: int | None) -> bool:
    """A replica that stopped on a spec or store mistake: relaunching fails the same way."""
    return exit_code == EXIT_CONFIG


PREEMPTED_CAUSE = "preempted: the platform sent {signal} to take the replica's machine away"
_PREEMPTED_HEAD = PREEMPTED_CAUSE.split("{", 1)[0]


def is_preemption(exit_code: int | None, error: str | None = None) -> bool:
    """A replica the platform took away: relaunch it, do not count it as a failure.

    Exit 75, or the runner's preemption cause as the error's first line with any exit code: a
    replica that took the platform's notice but was killed at the end of its grace period (a
    round still in flight, a slow machine) exits 137, and it was preempted all the same.
    """
    return exit_code == EXIT_PREEMPTED or cause(error).startswith(_PREEMPTED_HEAD)


# the cause line of a replica stopped at a time limit, for backends that only have logs: the
# runner's watchdog kills the replica's whole process group, itself included, so the exit code
# such a backend reads is SIGKILL's 137, and this line (the replica's last words) says what it was
TIME_LIMIT_CAUSE = "time limit: {what}"
_TIME_LIMIT_HEAD = TIME_LIMIT_CAUSE.split("{", 1)[0]


def is_time_limit(exit_code: int | None, error: str | None = None) -> bool:
    """A replica stopped at a time limit (the spec's `timeout` or the platform's wall-time limit):
    relaunch it, do not count it as a failure.

    Exit 124 (every backend reports a platform's time limit so: Slurm's TIMEOUT and DEADLINE,
    SageMaker's MaxRuntimeExceeded, Modal's timeout, a Job's DeadlineExceeded), or the runner's
    time-limit cause as the error's first line with any exit code.
    """
    return exit_code == EXIT_TIME_LIMIT or cause(error).startswith(_TIME_LIMIT_HEAD)


def code_failure_signature(error: str | None) -> str | None:
    """The cause of an exception raised by training code at a known global step, else None.

    Signals, OOM kills, preemptions and lost nodes never carry a step, so they never match.
    """
    first = cause(error)
    return first if STEP_MARK in first else None


def signal_cause(exit_code: int | None) -> str | None:
    """"killed by SIGKILL (exit code 137)" for a container's 128+N exit code, else None."""
    if exit_code is None or exit_code <= 128:
        return None
    import signal

    try:
        return f"killed by {signal.Signals(exit_code - 128).name} (exit code {exit_code})"
    except ValueError:
        return None


def shorten(text: str | None, limit: int = 2000) -> str | None:
    """At most `limit` characters: the cause line and the end of what follows it."""
    if text is None or len(text) <= limit:
        return text
    head = cause(text)[: limit // 4]
    return f"{head}\n…{text[-(limit - len(head) - 2):]}"


def cause_from_log(tail: str) -> str | None:
    """The cause line the in-replica bootstrap prints last, for backends that only have logs."""
    for line in reversed(tail.splitlines()):
        for prefix in (CAUSE_PREFIX, USER_ERROR_PREFIX):
            if line.startswith(prefix):
                return line[len(prefix):].strip()
    return None
