"""What the CLI shows: run progress while supervising, and a run's status from its records.

Rendering is kept out of the supervisor so the supervisor stays testable and backend-agnostic.
Metrics come from the run's object store (`diloco.metrics`), so they look the same on every
backend.
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .failures import cause
from .state import RunRecord

_EVENT_STYLE = {"diverged": "bold red", "training_alone": "bold red", "incident": "yellow", "failed": "red", "run_failed": "bold red", "give_up": "red", "run_succeeded": "bold green",
                "succeeded": "green", "relaunch_scheduled": "yellow", "gang_restart": "yellow",
                "run_cancelled": "yellow", "preempted": "yellow", "pending": "yellow", "cancelled": "yellow", "resumed": "cyan", "detached": "cyan",
                "poll_failed": "yellow", "poll_recovered": "cyan"}


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
    """Prints each new event of a run as it is logged (rounds included, see `Supervisor`); on a
    terminal, also a live progress bar below them (global step / total, round, tokens/s, ETA,
    members, restarts). Not on a terminal (CI, a log file) it prints the lines only.

    `spec`: print the run's estimate (`diloco.estimate`) once the replicas have measured the
    model, if the spec did not give its size.
    """

    def __init__(self, record: RunRecord, console: Console | None = None, *, live: bool | None = None,
                 spec: Any = None):
        self.record = record
        self.console = console or Console(highlight=False, soft_wrap=True)
        self.offset = 0  # bytes of the event log already printed
        self.events: list[dict[str, Any]] = []
        self.live_enabled = self.console.is_terminal if live is None else live
        self._live = None
        self._estimate_for = spec if spec is not None and not spec.diloco.get("parameters") else None

    def skip_existing(self) -> None:
        """Print only events logged from now on (a resumed launcher)."""
        self.events, self.offset = self.record.events_after(0)

    def __call__(self, _supervisor: Any = None) -> None:
        events, self.offset = self.record.events_after(self.offset)
        self.events += events
        for e in events:
            self.console.print(format_any(e), style=_EVENT_STYLE.get(e.get("event", "")), markup=False)
            if e.get("event") == "round" and self._estimate_for is not None:
                self._print_measured_estimate()
        if self.live_enabled:
            from .progress import progress_of, render_progress

            view = render_progress(progress_of(self.record.data, self.events, time.time()))
            if self._live is None:
                from rich.live import Live

                # redrawn on each tick (the supervisor's monitor interval), no refresh thread
                self._live = Live(view, console=self.console, auto_refresh=False, transient=True)
                self._live.start(refresh=True)
            else:
                self._live.update(view, refresh=True)

    def _print_measured_estimate(self) -> None:
        from .estimate import estimate, format_estimate
        from .metrics import RoundCache

        rounds = RoundCache(self.record.dir).load()
        if rounds and rounds[-1].parameters:
            spec, self._estimate_for = self._estimate_for, None
            text = format_estimate(estimate(spec, parameters=rounds[-1].parameters, parameters_from="measured at round 1",
                                            rendezvous=self.record.rendezvous))
            self.console.print(text, markup=False, end="")

    def close(self) -> None:
        """Stop the live display; the final progress line stays (lines only when not a terminal)."""
        if self._live is not None:
            from .progress import progress_line, progress_of

            self._live.stop()
            self._live = None
            self.console.print(progress_line(progress_of(self.record.data, self.events, time.time())),
                               markup=False)


def format_round(rnd: dict[str, Any]) -> str:
    loss = rnd.get("loss")
    parts = [f"round {rnd['round']}", f"members {rnd.get('members')}"]
    if rnd.get("step"):
        parts.append(f"step {rnd['step']}" + (f"/{rnd['total_steps']}" if rnd.get("total_steps") else ""))
    if isinstance(loss, (int, float)) and not isinstance(loss, bool):
        parts.append(f"loss {loss:.4f}")
    elif loss is not None:  # a record keeps a NaN loss as the string "nan" (valid JSON): show it, never crash on it
        parts.append(f"loss {str(loss)[:16]}")
    if rnd.get("tokens_per_s"):
        parts.append(f"{rnd['tokens_per_s']:,.0f} tok/s")
    if rnd.get("sync_share") is not None:
        parts.append(f"sync {100 * rnd['sync_share']:.1f}%")
    if rnd.get("straggler") is not None and rnd.get("waited_s"):
        parts.append(f"straggler {rnd['straggler']} (+{rnd['waited_s']:.2f} replica-s)")
    return "  ".join(parts)


def status_table(record: RunRecord, live: dict[int, str] | None) -> Table:
    table = Table(title=Text(f"run {record.run_id}  [{record.state}]"), title_justify="left")
    ranks = record.ranks
    grouped = any(r.group for r in ranks)
    for col in ("rank", *(("group", "backend") if grouped else ()), "attempt", "status", "restarts", "preempted",
                "last error"):
        table.add_column(col)
    for r in ranks:
        attempt = r.handle.attempt if r.handle else 0
        status = str((live or {}).get(r.rank, r.status))
        if r.relaunch_at:
            status += " (relaunch pending)"
        if r.given_up:
            status += " (given up)"
        # Text, not str: an error message is the replica's text, never rich markup ("[/]" would crash).
        where = (Text(r.group or "?"), Text(r.handle.backend_name if r.handle else "?")) if grouped else ()
        table.add_row(str(r.rank), *where, str(attempt), Text(status), str(r.restarts), str(r.preemptions),
                      Text(cause(r.last_error)[:80]))
    return table


def health_warnings(record: RunRecord, rounds: list[Any]) -> list[str]:
    """What makes a run unhealthy whatever its exit codes say: replicas never meeting, divergence."""
    out = []
    n = record.n_replicas
    if n > 1 and rounds and all(len(r.members) <= 1 for r in rounds):
        out.append(f"every round so far ({rounds[0].round}-{rounds[-1].round}) had a single member although the run "
                   f"has {n} replicas: they are training alone, not meeting in the store "
                   f"{record.rendezvous!r}")
    diverged = [r for r in rounds if r.diverged]
    if diverged:
        last = diverged[-1]
        out.append(f"replicas {last.diverged['minority']} held a global state different from "
                   f"{last.diverged['majority']} at round {last.round} ({len(diverged)} round(s) diverged; the "
                   f"minority reloads from a checkpoint)")
    return out
