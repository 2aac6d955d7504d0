"""The backend API: what a third-party backend builds on, and its version.

A backend written against an older version must fail in one line saying what to change, never
with a TypeError from deep inside core. The names below are the contract; anything else in
`diloco` may change without notice. A change that breaks a backend written against them raises
`BACKEND_API` and gets a line in packages/core/CHANGELOG.md saying how to migrate (a release that
carries it bumps diloco-core's version).

Version history (docs/writing-a-backend.md "The backend API"):

    1  options_from(options_type, options, overrides, backend=NAME)
    2  options_from(executor_class, options, overrides): `Options` and `backend_name` are read from
       the class, so a backend declares them once; `ReplicaHandle.of`, `ReplicaResult.failed` and
       `diloco.waiting.LastStatus` added; `unless_failed(handle, status, returned, *, cancelled)`
       asks a callable for the return value (API 1: `read_log(n_lines)`)
"""

from __future__ import annotations

from .errors import UserError

BACKEND_API = 2

# Module -> the names of it a backend may use.
NAMES: dict[str, tuple[str, ...]] = {
    "diloco": ("Capabilities", "Executor", "LaunchPlan", "LaunchRequest", "ReplicaHandle", "ReplicaResult",
               "ReplicaStatus", "Secrets", "BackendError", "UserError", "SpecError", "hookimpl", "option"),
    "diloco.options": ("option", "options_from"),
    "diloco.protocol": ("DescribesPending", "NumbersReruns", "HasLogFiles", "OPTIONAL_METHODS"),
    "diloco.submitting": ("start_each", "start_all"),
    "diloco.waiting": ("poll_until_terminal", "collect_results", "unless_failed", "LastStatus"),
    "diloco.procgroup": ("replica_command", "gpu_count", "node_env", "NODE_PORT"),
    "diloco.local": ("tail_text",),
    "diloco.testing": ("ExecutorConformance", "launch", "plan_for"),
}


class BackendAPIMismatch(UserError, TypeError):
    """A backend called core the way an older backend API did: one line saying what to change (a
    UserError, so the CLI prints that line; a TypeError, as the call's arguments are wrong)."""


def outdated(call: str, now: str, version: int) -> BackendAPIMismatch:
    """The error for a call in an older version's form: `call` as made, `now` as it is written today."""
    return BackendAPIMismatch(f"{call} is backend API {version}; diloco-core speaks backend API {BACKEND_API}: write "
                              f"{now} (docs/writing-a-backend.md#the-backend-api)")
