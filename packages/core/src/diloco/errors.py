"""Errors diloco raises on purpose.

`UserError` is the one a person caused (a bad spec, an unknown backend, a missing run): the
CLI prints its message as a single line and exits with code 2 — never a traceback. Anything
else escaping a command is a bug and keeps its traceback.
"""

from __future__ import annotations

# The exit status of a replica that stopped on a `UserError` (sysexits.h EX_CONFIG): the same
# spec would fail the same way again, so the supervisor fails the run instead of relaunching.
EXIT_CONFIG = 78
# The exit status of a replica the platform took away (sysexits.h EX_TEMPFAIL: try again): a
# preempted Modal container, a reclaimed spot instance. The supervisor relaunches it without
# spending the restart budget that code failures use (see `[restart] max_preemptions`).
EXIT_PREEMPTED = 75
# The exit status of a replica that reached a time limit: the spec's `timeout` (the runner's
# watchdog) or the platform's wall-time limit (Slurm's TIMEOUT, SageMaker's MaxRuntimeInSeconds,
# Modal's timeout, a Job's activeDeadlineSeconds), as timeout(1) reports one. A lifecycle event:
# relaunched without spending the failure budgets (see `[restart] max_time_limits_per_rank`).
EXIT_TIME_LIMIT = 124


class DilocoError(Exception):
    """Base class of every error diloco raises deliberately."""


class UserError(DilocoError):
    """A mistake the user can fix: the message says what is wrong and how to fix it."""

    exit_code = 2


class SpecError(UserError):
    """The run spec is invalid; the message names the file and the key."""


class BackendNotFound(UserError):
    """No installed plugin provides the requested backend."""


class RunNotFound(UserError):
    """No record of the requested run in the state directory."""


class DamagedRecord(UserError):
    """A record the launcher keeps (run.json) cannot be read back: cut short by a crash or a full
    disk, or edited by hand. The message names the file and what is wrong with it."""


class StateDirFull(UserError):
    """The launcher's state directory cannot be written (a full disk, a quota): the launcher stops
    with its records as they were (each written whole or not at all); the replicas train on, and
    `diloco resume` takes over once there is space."""


class StoreUnusable(UserError):
    """The rendezvous store cannot serve a run (unreachable, read-only, or ignores create-only puts)."""


class BackendError(DilocoError):
    """The backend refused or failed an operation (an API error, a missing credential)."""
