"""The `diloco` command line. Thin: each command parses, calls the library, renders.

A `UserError` anywhere becomes one line on stderr and exit code 2; a failed run exits 1.
"""

from __future__ import annotations

import json
import os
import sys
import time

import click

from .errors import BackendError, UserError


class _Group(click.Group):
    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except UserError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except BackendError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(1)


@click.group(cls=_Group)
@click.version_option(package_name="diloco-core", prog_name="diloco")
def main() -> None:
    """Run DiLoCo training on whatever GPUs you can rent."""


@main.command()
@click.argument("name", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
def backends(name: str | None, as_json: bool) -> None:
    """List installed backends; with NAME, that backend's [backend] options (name, type, default, help)."""
    from rich.console import Console
    from rich.table import Table

    from .plugins import backends as found, broken_plugins, get_backend

    console = Console(width=140, highlight=False)
    if name:
        from .plugins import backend_options

        info = get_backend(name)
        options = backend_options(info.cls)
        if as_json:
            click.echo(json.dumps({"backend": info.name, "distribution": info.distribution, "version": info.version,
                                   "options": [o.to_dict() for o in options]}, indent=2, default=str))
            return
        console.print(f"{info.name} ({info.distribution} {info.version}): options for the spec's [backend] table",
                      markup=False)
        from rich.text import Text

        table = Table("option", "type", "default", "help")
        for o in options:  # Text: a type like list[str] or a help's [r] is not rich markup
            default = "(required)" if o.required else "-" if o.default is None else json.dumps(o.default, default=str)
            table.add_row(*(Text(x) for x in (o.name, o.type, default, o.help)))
        console.print(table)
        return
    infos = list(found().values())
    if as_json:
        click.echo(json.dumps([{"backend": i.name, "distribution": i.distribution, "version": i.version}
                               for i in infos], indent=2))
        return
    from rich.text import Text

    table = Table("backend", "distribution", "version")
    for info in infos:  # Text: what a plugin's metadata says is shown, never read as markup
        table.add_row(Text(info.name), Text(info.distribution), Text(str(info.version)))
    console.print(table)
    for b in broken_plugins():
        console.print(f"plugin {b.name} from {b.distribution} failed to load: {b.error}", style="red", markup=False)
    console.print("options of one backend: diloco backends NAME", markup=False)


@main.command()
@click.argument("spec_path", metavar="SPEC")
@click.option("--format", "fmt", type=click.Choice(["auto", "json", "yaml"]), default="auto",
              help="Output format (auto: what the backend's request is usually written in).")
def dryrun(spec_path: str, fmt: str) -> None:
    """Print exactly what `diloco run SPEC` would submit, secrets redacted; then (on stderr) what the
    run will cost: bytes, store requests and money at list prices."""
    from .estimate import estimate, format_estimate
    from .launcher import plan_run
    from .spec import load_spec

    spec = load_spec(spec_path)
    plan = plan_run(spec)
    click.echo(format_estimate(estimate(spec, rendezvous=plan.request.rendezvous)), err=True, nl=False)
    click.echo(plan.render(fmt), nl=False)


def _supervise(handle, on_interrupt: str, printer) -> None:
    """Supervise `handle` (a `diloco.api.Run`) in this process, showing its progress; exit with
    the run's outcome."""
    from rich.console import Console

    from .failures import cause
    from .supervisor import RunFailed

    console = Console(highlight=False, soft_wrap=True)
    run_id = handle.id
    try:
        try:
            state = handle.supervise(on_tick=printer)
        finally:
            printer.close()  # the live progress display, if any, before the outcome lines
    except RunFailed as exc:
        console.print(f"run {run_id} FAILED: {exc}", style="bold red", markup=False)
        groups = handle.record.rank_groups
        for rank, err in sorted(exc.errors.items()):
            if err:
                where = f" ({groups[rank]})" if rank in groups else ""
                console.print(f"  rank {rank}{where}: {cause(err)}", style="red", markup=False)
        console.print(f"  full errors: diloco status {run_id}", markup=False)
        sys.exit(1)
    except KeyboardInterrupt:
        record, sup = handle.record, handle.supervisor
        choice = on_interrupt
        if choice == "ask":
            choice = "cancel"
            if sys.stdin.isatty():
                try:
                    choice = click.prompt("\ninterrupted: cancel the run or detach (replicas keep running)?",
                                          type=click.Choice(["cancel", "detach"]), default="detach")
                except (click.Abort, EOFError):
                    choice = "cancel"
        if choice == "detach":
            record.event("detached", pid=os.getpid())
            console.print(f"detached; replicas keep running. Reattach: diloco resume {run_id}", markup=False)
            sys.exit(130)
        console.print("cancelling…", markup=False)
        record.request_cancel()
        if sup is not None:
            sup.tick()
        sys.exit(130)
    if state == "STOPPED":
        console.print(f"run {run_id} was cancelled", style="yellow", markup=False)
        sys.exit(1)
    console.print(f"run {run_id} SUCCEEDED", style="bold green", markup=False)
    _show_artifacts(handle.record, console)


def _show_artifacts(record, console) -> None:
    """Copy the run's artifacts next to its records; print its summary if it wrote one."""
    from .artifacts import collect_artifacts

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


_INTERRUPT = click.option("--on-interrupt", type=click.Choice(["ask", "cancel", "detach"]), default="ask",
                          show_default=True, help="What Ctrl-C does; `ask` prompts on a terminal, else cancels.")


@main.command()
@click.argument("spec_path", metavar="SPEC")
@_INTERRUPT
def run(spec_path: str, on_interrupt: str) -> None:
    """Launch a run from SPEC, supervise it, and wait for it to end."""
    from . import api
    from .display import ProgressPrinter
    from .estimate import estimate, format_estimate

    spec = api.load(spec_path)
    handle = api.launch(spec, background=False)
    sup = handle.supervisor
    where = ", ".join(f"{g.name} {g.replicas} × {g.backend}" for g in spec.groups) or f"{spec.replicas} × {spec.backend}"
    click.echo(f"run {handle.id}: {where}, store {sup.request.rendezvous}")
    click.echo(format_estimate(estimate(spec, rendezvous=sup.request.rendezvous)), nl=False)
    _supervise(handle, on_interrupt, ProgressPrinter(sup.record, spec=spec))


@main.command()
@click.argument("run_id", metavar="RUN")
@_INTERRUPT
def resume(run_id: str, on_interrupt: str) -> None:
    """Reattach to a run whose launcher died or detached, and supervise it to the end."""
    from . import api
    from .display import ProgressPrinter

    handle = api.attach(run_id)
    printer = ProgressPrinter(handle.record)
    printer.skip_existing()
    _supervise(handle, on_interrupt, printer)


@main.command()
@click.argument("run_id", metavar="RUN")
@click.option("--json", "as_json", is_flag=True,
              help="Print everything as JSON: record, live statuses, events, rounds, progress, timeline, estimate.")
@click.option("--events", "n_events", default=10, show_default=True, help="How many recent events to show.")
@click.option("--timeline", is_flag=True, help="Seconds per phase for each replica in the last rounds, and stragglers.")
@click.option("--rounds", "n_rounds", default=5, show_default=True, help="How many rounds --timeline shows.")
@click.option("--follow", "-f", is_flag=True, help="Keep showing progress until the run ends (from any shell).")
def status(run_id: str, as_json: bool, n_events: int, timeline: bool, n_rounds: int, follow: bool) -> None:
    """Show a run's state, each rank's live status, progress, recent events and round metrics."""
    from rich.console import Console

    from . import api
    from .display import status_table

    handle = api.attach(run_id)
    record = handle.record
    if follow:
        return _follow_run(handle)
    view = handle.view()
    live = view["live"]
    if view["live_error"]:
        click.echo(f"warning: cannot poll replicas live ({view['live_error']}); showing recorded statuses", err=True)
    if as_json:
        from .statedir import to_json

        view.pop("rounds_objects")
        click.echo(to_json(view, indent=2, default=str))  # valid JSON always: no NaN for scripts to choke on
        return
    console = Console(width=140, highlight=False)
    if timeline:
        _print_timeline(console, view["rounds_objects"][-n_rounds:], view["rounds_objects"], record.rank_groups)
        return
    console.print(status_table(record, live))
    _print_status_body(console, record, view, n_events)


def _print_status_body(console, record, view: dict, n_events: int) -> None:
    from .display import format_any, format_round, health_warnings
    from .progress import Progress, progress_line

    rounds = view["rounds_objects"]
    ended = record.ended
    from .api import launcher_alive

    if not ended and not launcher_alive(record):
        console.print(f"no launcher is supervising this run: diloco resume {record.run_id}", style="yellow",
                      markup=False)
    if record.failure:
        console.print(f"failure: {record.failure}", style="red", markup=False)
    for warning in health_warnings(record, rounds):
        console.print(f"WARNING: {warning}", style="bold red", markup=False)
    console.print("progress: " + progress_line(Progress(**view["progress"])), markup=False)
    if rounds:
        from dataclasses import asdict

        console.print(f"rounds: {len(rounds)}; latest:", markup=False)
        for rnd in rounds[-3:]:
            console.print("  " + format_round({**asdict(rnd), "waited_s": rnd.waited_s}), markup=False)
        c, est = view["counted"], (view.get("estimate") or {}).get("for_counted_rounds")
        line = (f"traffic: {c['bytes_up'] / 1e6:,.1f} MB up, {c['bytes_down'] / 1e6:,.1f} MB down, "
                f"{c.get('puts', 0) + c.get('gets', 0) + c.get('lists', 0) - c.get('polls', 0):,} requests "
                f"+ {c.get('polls', 0):,} polls over {c['rounds']} rounds")
        if est:
            line += (f" (estimated {est['bytes_up'] / 1e6:,.1f} MB up, {est['bytes_down'] / 1e6:,.1f} MB down, "
                     f"{est['requests']:,.0f} requests)")
        console.print(line, markup=False)
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


def _print_timeline(console, shown: list, rounds: list, groups: dict[int, str] | None = None) -> None:
    from .progress import straggler_lines, timeline_table

    if not shown:
        console.print("no rounds recorded yet", markup=False)
        return
    console.print(timeline_table(shown, groups))
    for line in straggler_lines(rounds, groups):
        console.print(line, markup=False)


def _follow_run(handle) -> None:
    """`status --follow`: the run's events and live progress until it ends, from any shell."""
    from .display import ProgressPrinter

    record = handle.record
    printer = ProgressPrinter(record)
    try:
        while True:
            record.data = handle.record.data
            printer()
            if record.ended:
                printer()
                break
            if not handle.supervised() and time.time() - record.updated_at > 30:
                printer.close()
                raise UserError(f"no launcher is supervising run {record.run_id}; progress stopped at its last "
                                f"event (diloco resume {record.run_id})")
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        printer.close()
    click.echo(f"run {record.run_id} {record.state}")


@main.command()
@click.argument("run_id", metavar="RUN")
@click.option("--rank", type=int, default=None, help="Only this rank (default: every rank).")
@click.option("--attempt", type=int, default=None, help="This attempt (default: the latest).")
@click.option("-n", "--lines", "n_lines", type=int, default=200, show_default=True)
@click.option("--follow", "-f", is_flag=True, help="Keep printing new output until the replica ends.")
def logs(run_id: str, rank: int | None, attempt: int | None, n_lines: int, follow: bool) -> None:
    """Print replicas' output."""
    from . import api

    handle = api.attach(run_id)
    handles = handle.log_handles(rank, attempt)
    executor = handle.executor()
    if follow:
        if len(handles) != 1:
            raise UserError("--follow needs one replica: add --rank R")
        _follow(executor, handles[0], n_lines)
        return
    for h in handles:
        if len(handles) > 1:
            click.echo(f"==> rank {h.rank} attempt {h.attempt} <==")
        click.echo(executor.stream_logs(h, n_lines=n_lines), nl=False)


def _follow(executor, handle, n_lines: int) -> None:
    """Print the tail, then new lines as they come, until the replica ends."""
    seen = executor.stream_logs(handle, n_lines=n_lines)
    click.echo(seen, nl=False)
    if not executor.capabilities.log_files:  # remote backends: re-read the tail and print what is new
        while not executor.poll(handle).is_terminal:
            time.sleep(1.0)
            text = executor.stream_logs(handle, n_lines=n_lines)
            new = text[len(seen):] if text.startswith(seen) else text.splitlines(keepends=True)[-1:]
            click.echo("".join(new), nl=False)
            seen = text
        return
    log_path = executor.log_path(handle)
    pos = log_path.stat().st_size if log_path.exists() else 0
    while True:
        done = executor.poll(handle).is_terminal
        if log_path.exists():
            with open(log_path, "rb") as f:
                f.seek(pos)
                chunk = f.read()
                pos += len(chunk)
            if chunk:
                click.echo(chunk.decode("utf-8", "replace"), nl=False)
        if done:
            return
        time.sleep(0.2)


@main.command()
@click.argument("run_id", metavar="RUN")
def cancel(run_id: str) -> None:
    """Stop every replica of a run (idempotent), from any shell."""
    from . import api

    handle = api.attach(run_id)
    n = handle.cancel()
    click.echo(f"cancelled run {handle.id} ({n} replicas)")


@main.command(name="list")
@click.option("--limit", default=20, show_default=True)
def list_runs(limit: int) -> None:
    """List recorded runs, newest first."""
    from datetime import datetime

    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from . import api

    table = Table("run", "backend", "replicas", "state", "created")
    for run in api.runs(limit):
        data = run.record.data
        spec = data.get("spec", {})
        created = datetime.fromtimestamp(data.get("created_at", 0)).strftime("%Y-%m-%d %H:%M:%S")
        groups = ", ".join(f"{g.get('name')} {g.get('replicas')}" for g in spec.get("groups") or [])
        replicas = f"{spec.get('replicas', '?')}" + (f" ({groups})" if groups else "")
        table.add_row(*(Text(str(x)) for x in (run.id, spec.get("backend", "?"), replicas,
                                                   data.get("state", "?"), created)))  # records are shown, never read as markup
    Console(width=140, highlight=False).print(table)


if __name__ == "__main__":
    main()
