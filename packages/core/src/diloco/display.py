"""What the CLI shows: run progress while supervising, and a run's status from its records.

Rendering is kept out of the supervisor so the supervisor stays testable and backend-agnostic.
Metrics come from the run's object store (`diloco.metrics`), so they look the same on every
backend.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from rich.console import Console
from rich.table import Table

from .failures import cause
from .state import RunRecord

_EVENT_STYLE = {"diverged": "bold red", "training_alone": "bold red", "incident": "yellow", "failed": "red", "run_failed": "bold red", "give_up": "red", "run_succeeded": "bold green",
                "succeeded": "green", "relaunch_scheduled": "yellow", "gang_restart": "yellow",
                "run_cancelled": "yellow", "preempted": "yellow", "pending": "yellow", "cancelled": "yellow", "resumed": "cyan", "detached": "cyan"}


def _clock(t: float) -> str:
    return datetime.fromtimestamp(t).strftime("%H:%M:%S")


def format_event(e: dict[str, Any]) -> str:
    kind = e.get("event", "?")
    fields = {k: v for k, v in e.items() if k not in ("t", "event")}
    if kind in ("failed", "preempted") and fields.get("error"):
        fields["error"] = cause(str(fields.pop("error")))
    if kind == "run_failed":
        fields.pop("errors", None)
    body = " ".join(f"{k}={v}" for k, v in fields.items())
    return f"{_clock(e.get('t', 0))} {kind} {body}".rstrip()


def format_any(e: dict[str, Any]) -> str:
    """An event line as `diloco run` and `diloco status` both print it."""
    return format_round(e) if e.get("event") == "round" else format_event(e)


class ProgressPrinter:
    """Prints each new event of a run as it is logged (rounds included, see `Supervisor`)."""

    def __init__(self, record: RunRecord, console: Console | None = None):
        self.record = record
        self.console = console or Console(highlight=False, soft_wrap=True)
        self.offset = 0  # bytes of the event log already printed

    def skip_existing(self) -> None:
        """Print only events logged from now on (a resumed launcher)."""
        self.offset = self.record.events_after(0)[1]

    def __call__(self, _supervisor: Any = None) -> None:
        events, self.offset = self.record.events_after(self.offset)
        for e in events:
            self.console.print(format_any(e), style=_EVENT_STYLE.get(e.get("event", "")), markup=False)


def format_round(rnd: dict[str, Any]) -> str:
    loss = rnd.get("loss")
    parts = [f"round {rnd['round']}", f"members {rnd.get('members')}"]
    if loss is not None:
        parts.append(f"loss {loss:.4f}")
    if rnd.get("tokens_per_s"):
        parts.append(f"{rnd['tokens_per_s']:,.0f} tok/s")
    if rnd.get("sync_share") is not None:
        parts.append(f"sync {100 * rnd['sync_share']:.1f}%")
    return "  ".join(parts)


def status_table(record: RunRecord, live: dict[int, str] | None) -> Table:
    table = Table(title=f"run {record.run_id}  [{record.data.get('state', '?')}]", title_justify="left")
    for col in ("rank", "attempt", "status", "restarts", "preempted", "last error"):
        table.add_column(col)
    for r in record.data.get("ranks", []):
        handle = r.get("handle") or {}
        attempt = (handle.get("metadata") or {}).get("attempt", 0)
        status = (live or {}).get(r["rank"], r.get("status", "?"))
        if r.get("relaunch_at"):
            status += " (relaunch pending)"
        if r.get("given_up"):
            status += " (given up)"
        table.add_row(str(r["rank"]), str(attempt), status, str(r.get("restarts", 0)),
                      str(r.get("preemptions", 0)), cause(r.get("last_error"))[:80])
    return table


def health_warnings(record: RunRecord, rounds: list[Any]) -> list[str]:
    """What makes a run unhealthy whatever its exit codes say: replicas never meeting, divergence."""
    out = []
    n = int(record.data.get("launch", {}).get("n_replicas") or 0)
    if n > 1 and rounds and all(len(r.members) <= 1 for r in rounds):
        out.append(f"every round so far ({rounds[0].round}-{rounds[-1].round}) had a single member although the run "
                   f"has {n} replicas: they are training alone, not meeting in the store "
                   f"{record.data.get('launch', {}).get('rendezvous')!r}")
    diverged = [r for r in rounds if r.diverged]
    if diverged:
        last = diverged[-1]
        out.append(f"replicas {last.diverged['minority']} held a global state different from "
                   f"{last.diverged['majority']} at round {last.round} ({len(diverged)} round(s) diverged; the "
                   f"minority reloads from a checkpoint)")
    return out
