"""Why a replica's pod failed, in words: the cause first (the rule in `diloco.bootstrap.failures`)."""

from __future__ import annotations

from typing import Any

from diloco.errors import EXIT_TIME_LIMIT
from diloco.bootstrap.failures import cause_from_log, signal_cause


def exit_cause(code: int | None, reason: str | None) -> str:
    """OOM kill, signal, or exit code of the pod's container."""
    if reason == "OOMKilled":
        return f"OOM-killed (exit code {code})"
    killed = signal_cause(code)
    if killed:
        return killed
    return f"pod exited with code {code}" if code is not None else f"pod failed{f' ({reason})' if reason else ''}"


def deadline_cause(job: dict[str, Any] | None) -> str | None:
    """The Job's time limit, if that is what ended it: the spec's timeout as activeDeadlineSeconds,
    which fails the Job (DeadlineExceeded) and stops its pods. None for any other ending."""
    for c in ((job or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == "Failed" and c.get("status") == "True" and c.get("reason") == "DeadlineExceeded":
            name = ((job or {}).get("metadata") or {}).get("name", "the Job")
            return f"Job {name} reached its activeDeadlineSeconds (the spec's timeout; exit code {EXIT_TIME_LIMIT})"
    return None


def failure_text(job: dict[str, Any] | None, term: dict[str, Any] | None, tail: str) -> str:
    """A failed rank's error: what the replica said (if it said why it stopped), the container's
    exit, its termination message, the Job's Failed conditions, then the log's last lines."""
    code = term.get("exitCode") if term else None
    parts = [exit_cause(code, (term or {}).get("reason"))]
    if term and term.get("message"):
        parts.append(term["message"])
    conditions = ((job or {}).get("status") or {}).get("conditions") or []
    parts += [f"{c.get('reason')}: {c.get('message')}" for c in conditions
              if c.get("type") == "Failed" and c.get("status") == "True"]
    error = "; ".join(parts) + (f"\n{tail}" if tail else "")
    cause = cause_from_log(tail)
    return f"{cause}\n{error}" if cause else error  # the replica's own reason comes before the pod's exit


def lost_node_text(job: dict[str, Any] | None, nodes: int) -> str:
    """A replica of several nodes whose Job failed with no pod left that says why: one was
    deleted or lost with its node (it counts as a failure), and Kubernetes stopped the others."""
    name = ((job or {}).get("metadata") or {}).get("name", "the Job")
    conditions = ((job or {}).get("status") or {}).get("conditions") or []
    why = "; ".join(f"{c.get('reason')}: {c.get('message')}" for c in conditions
                    if c.get("type") == "Failed" and c.get("status") == "True")
    return (f"Job {name} failed ({why or 'Failed'}) and no pod of the replica's {nodes} nodes says why: one was "
            "deleted or lost with its node, and Kubernetes stopped the others")
