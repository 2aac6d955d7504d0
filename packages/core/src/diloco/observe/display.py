"""What the CLI shows: run progress while supervising, a run's status and timeline from its
records, and the tables of `diloco backends` and `diloco list`.

Rendering is kept out of the supervisor so the supervisor stays testable and backend-agnostic.
Metrics come from the run's object store (`diloco.store.metrics`), so they look the same on every
backend.
"""

from __future__ import annotations

import json
import time
from datetime import datetime
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..errors import DamagedRecord
from ..bootstrap.failures import cause
from ..runrecord.state import RunRecord

_EVENT_STYLE = {"diverged": "bold red", "training_alone": "bold red", "incident": "yellow", "failed": "red", "run_failed": "bold red", "give_up": "red", "run_succeeded": "bold green",
                "succeeded": "green", "relaunch_scheduled": "yellow", "gang_restart": "yellow",
                "run_cancelled": "yellow", "preempted": "yellow", "time_limit": "yellow", "cancelled_outside": "yellow",
                "pending": "yellow", "cancelled": "yellow", "resumed": "cyan", "detached": "cyan",
                "poll_failed": "yellow", "poll_recovered": "cyan"}


def _clock(t: float) -> str:
    return datetime.fromtimestamp(t).strftime("%H:%M:%S")


def format_event(e: dict[str, Any]) -> str:
    kind = e.get("event", "?")
    fields = {k: v for k, v in e.items() if k not in ("t", "event")}
    if kind in ("failed", "preempted", "time_limit", "cancelled_outside") and fields.get("error"):
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

    `spec`: print the run's estimate (`diloco.spec.estimate`) once the replicas have measured the
    model, if the spec did not give its size. `record` may be swapped for a newer snapshot of the
    same run (`diloco.api.Run.follow`): what was printed is counted in bytes of its event log.
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
        from ..spec.estimate import estimate, format_estimate
        from ..store.metrics import RoundCache

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
                "time limits", "last error"):
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
                      str(r.time_limits), Text(cause(r.last_error)[:80]))
    return table


def health_warnings(record: RunRecord, rounds: list[Any]) -> list[str]:
    """What makes a run unhealthy whatever its exit codes say: the store not answering, replicas
    never meeting, divergence."""
    out = []
    away = (record.data.get("health") or {}).get("store_unreachable")
    if isinstance(away, dict) and not record.ended:
        out.append(f"the store {record.rendezvous!r} has not answered the launcher since "
                   f"{_when(away.get('since'))}: {away.get('error')}; the replicas wait for it (store_outage_limit)")
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


def _when(t: Any) -> str:
    import time

    return time.strftime("%H:%M:%S", time.localtime(t)) if isinstance(t, (int, float)) else "?"


# -- how `diloco run` and `diloco resume` end ----------------------------------------------------


def print_failed(console: Console, record: RunRecord, exc: Any) -> None:
    """A failed run (`exc`, the supervisor's `RunFailed`): each rank's cause, with its group, and
    where the full errors are."""
    console.print(f"run {record.run_id} FAILED: {exc}", style="bold red", markup=False)
    groups = record.rank_groups
    for rank, err in sorted(exc.errors.items()):
        if err:
            where = f" ({groups[rank]})" if rank in groups else ""
            console.print(f"  rank {rank}{where}: {cause(err)}", style="red", markup=False)
    console.print(f"  full errors: diloco status {record.run_id}", markup=False)


def print_succeeded(console: Console, record: RunRecord) -> None:
    """A succeeded run: its artifacts copied next to its records (`diloco.runrecord.artifacts`) and its
    summary printed, if it wrote one."""
    from ..runrecord.artifacts import collect_artifacts

    console.print(f"run {record.run_id} SUCCEEDED", style="bold green", markup=False)
    try:
        files = collect_artifacts(record)
    except Exception as exc:  # the run succeeded; a report we cannot fetch must not turn that into a failure
        console.print(f"(could not copy the run's artifacts: {exc})", style="yellow", markup=False)
        return
    for f in files:
        if f.name == "summary.txt":
            console.print(f.read_text(), markup=False, end="")
    if files:
        console.print(f"artifacts: {files[0].parent}", markup=False)


# -- what `diloco status` prints ----------------------------------------------------------------


def print_status(console: Console, record: RunRecord, view: dict[str, Any], n_events: int, *,
                 supervised: bool) -> None:
    """`diloco status RUN`: each rank's row, then what needs a person (no launcher, the failure,
    health warnings), progress, the latest rounds with the traffic counted against the estimate,
    recent events and the run's summary. `view` is `diloco.api.Run.view()`; `supervised`,
    whether a launcher still supervises it (`diloco.observe.liveness.launcher_alive`)."""
    from dataclasses import asdict

    from .progress import Progress, progress_line

    console.print(status_table(record, view["live"]))
    rounds = view["rounds_objects"]
    if not record.ended and not supervised:
        console.print(f"no launcher is supervising this run: diloco resume {record.run_id}", style="yellow",
                      markup=False)
    if record.failure:
        console.print(f"failure: {record.failure}", style="red", markup=False)
    if record.stopped_because:
        console.print(f"stopped: {record.stopped_because}", style="yellow", markup=False)
    for warning in health_warnings(record, rounds):
        console.print(f"WARNING: {warning}", style="bold red", markup=False)
    console.print("progress: " + progress_line(Progress(**view["progress"])), markup=False)
    if rounds:
        console.print(f"rounds: {len(rounds)}; latest:", markup=False)
        for rnd in rounds[-3:]:
            console.print("  " + format_round({**asdict(rnd), "waited_s": rnd.waited_s}), markup=False)
        console.print(traffic_line(view["counted"], (view.get("estimate") or {}).get("for_counted_rounds")),
                      markup=False)
    events = view["events"][-n_events:]
    if events:
        console.print("events:", markup=False)
        for e in events:
            console.print("  " + format_any(e), markup=False)
    artifacts = record.dir / "artifacts"
    if (artifacts / "summary.txt").exists():
        console.print((artifacts / "summary.txt").read_text(), markup=False, end="")
    if artifacts.is_dir():
        console.print(f"artifacts: {artifacts}", markup=False)


def traffic_line(c: dict[str, Any], est: dict[str, Any] | None) -> str:
    """The traffic the replicas counted (`diloco.spec.estimate.estimate_view`), protocol requests and
    waiting polls apart, and the estimate for the same rounds if there is one."""
    line = (f"traffic: {c['bytes_up'] / 1e6:,.1f} MB up, {c['bytes_down'] / 1e6:,.1f} MB down, "
            f"{c.get('puts', 0) + c.get('gets', 0) + c.get('lists', 0) - c.get('polls', 0):,} requests "
            f"+ {c.get('polls', 0):,} polls over {c['rounds']} rounds")
    if est:
        line += (f" (estimated {est['bytes_up'] / 1e6:,.1f} MB up, {est['bytes_down'] / 1e6:,.1f} MB down, "
                 f"{est['requests']:,.0f} requests)")
    return line


def print_timeline(console: Console, shown: list[Any], rounds: list[Any],
                   groups: dict[int, str] | None = None) -> None:
    """`diloco status RUN --timeline`: the `shown` rounds phase by phase, then the stragglers over
    all `rounds`."""
    from .progress import straggler_lines, timeline_table

    if not shown:
        console.print("no rounds recorded yet", markup=False)
        return
    console.print(timeline_table(shown, groups))
    for line in straggler_lines(rounds, groups):
        console.print(line, markup=False)


# -- what `diloco backends` and `diloco list` print ---------------------------------------------
# Text cells throughout: what a plugin's metadata or a record says is shown, never read as markup
# (a type like list[str], a help's [r]).


def backends_table(infos: list[Any]) -> Table:
    """Installed backends (`diloco.plugins.discovery.BackendInfo`): name, distribution, version."""
    table = Table("backend", "distribution", "version")
    for info in infos:
        table.add_row(Text(info.name), Text(info.distribution), Text(str(info.version)))
    return table


def options_table(options: list[Any]) -> Table:
    """One backend's `[backend]` options (`diloco.options.BackendOption`)."""
    table = Table("option", "type", "default", "help")
    for o in options:
        default = "(required)" if o.required else "-" if o.default is None else json.dumps(o.default, default=str)
        table.add_row(*(Text(x) for x in (o.name, o.type, default, o.help)))
    return table


def runs_table(runs: list[Any]) -> Table:
    """Recorded runs (`diloco.api.Run`), in the order given: id, backend, replicas (per group), state, created."""
    table = Table("run", "backend", "replicas", "state", "created")
    for run in runs:
        try:
            data = run.record.data
        except DamagedRecord:  # one run's damaged record hides none of the others (`diloco status` says why)
            table.add_row(Text(run.id), Text("?"), Text("?"), Text("DAMAGED run.json"), Text("?"))
            continue
        spec = data.get("spec") or {}
        created = datetime.fromtimestamp(data.get("created_at", 0)).strftime("%Y-%m-%d %H:%M:%S")
        groups = ", ".join(f"{g.get('name')} {g.get('replicas')}" for g in spec.get("groups") or [])
        replicas = f"{spec.get('replicas', '?')}" + (f" ({groups})" if groups else "")
        table.add_row(*(Text(str(x)) for x in (run.id, spec.get("backend", "?"), replicas, data.get("state", "?"),
                                               created)))
    return table
