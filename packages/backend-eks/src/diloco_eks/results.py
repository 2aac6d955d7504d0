"""Why a replica's pod failed, in words: the cause first (the rule in `diloco.failures`)."""

from __future__ import annotations

from typing import Any

from diloco.failures import cause_from_log, signal_cause


def exit_cause(code: int | None, reason: str | None) -> str:
    """OOM kill, signal, or exit code of the pod's container."""
    if reason == "OOMKilled":
        return f"OOM-killed (exit code {code})"
    killed = signal_cause(code)
    if killed:
        return killed
    return f"pod exited with code {code}" if code is not None else f"pod failed{f' ({reason})' if reason else ''}"


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
