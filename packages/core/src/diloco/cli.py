"""The `diloco` command line. Thin: each command parses, calls the Python API (`diloco.api`),
and prints what `diloco.observe.display` renders.

A `UserError` anywhere becomes one line on stderr and exit code 2; a failed run exits 1.
"""

from __future__ import annotations

import json
import os
import sys

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

    from .observe.display import backends_table, options_table
    from .plugins.discovery import backends as found, broken_plugins, get_backend

    console = Console(width=140, highlight=False)
    if name:
        from .plugins.discovery import backend_options

        info = get_backend(name)
        options = backend_options(info.cls)
        if as_json:
            click.echo(json.dumps({"backend": info.name, "distribution": info.distribution, "version": info.version,
                                   "options": [o.to_dict() for o in options]}, indent=2, default=str))
            return
        console.print(f"{info.name} ({info.distribution} {info.version}): options for the spec's [backend] table",
                      markup=False)
        console.print(options_table(options))
        return
    infos = list(found().values())
    if as_json:
        click.echo(json.dumps([{"backend": i.name, "distribution": i.distribution, "version": i.version}
                               for i in infos], indent=2))
        return
    console.print(backends_table(infos))
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
    from .spec.estimate import estimate, format_estimate
    from .launching.launcher import plan_run
    from .spec.runspec import load_spec

    spec = load_spec(spec_path)
    plan = plan_run(spec)
    click.echo(format_estimate(estimate(spec, rendezvous=plan.request.rendezvous)), err=True, nl=False)
    click.echo(plan.render(fmt), nl=False)


def _supervise(handle, on_interrupt: str, printer) -> None:
    """Supervise `handle` (a `diloco.api.Run`) in this process, showing its progress; exit with
    the run's outcome."""
    from rich.console import Console

    from .observe.display import print_failed, print_succeeded
    from .supervise.supervisor import RunFailed

    console = Console(highlight=False, soft_wrap=True)
    run_id = handle.id
    try:
        try:
            state = handle.supervise(on_tick=printer)
        finally:
            printer.close()  # the live progress display, if any, before the outcome lines
    except RunFailed as exc:
        print_failed(console, handle.record, exc)
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
        why = handle.record.stopped_because
        console.print(f"run {run_id} was cancelled{f': {why}' if why else ''}", style="yellow", markup=False)
        sys.exit(1)
    print_succeeded(console, handle.record)


_INTERRUPT = click.option("--on-interrupt", type=click.Choice(["ask", "cancel", "detach"]), default="ask",
                          show_default=True, help="What Ctrl-C does; `ask` prompts on a terminal, else cancels.")


@main.command()
@click.argument("spec_path", metavar="SPEC")
@_INTERRUPT
def run(spec_path: str, on_interrupt: str) -> None:
    """Launch a run from SPEC, supervise it, and wait for it to end."""
    from . import api
    from .observe.display import ProgressPrinter
    from .spec.estimate import estimate, format_estimate

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
    from .observe.display import ProgressPrinter

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
    from .observe.display import print_status, print_timeline
    from .observe.liveness import launcher_alive

    handle = api.attach(run_id)
    if follow:
        return _follow_run(handle)
    record = handle.record
    view = handle.view()
    if view["live_error"]:
        click.echo(f"warning: cannot poll replicas live ({view['live_error']}); showing recorded statuses", err=True)
    if as_json:
        from .host.statedir import to_json

        view.pop("rounds_objects")
        click.echo(to_json(view, indent=2, default=str))  # valid JSON always: no NaN for scripts to choke on
        return
    console = Console(width=140, highlight=False)
    if timeline:
        print_timeline(console, view["rounds_objects"][-n_rounds:], view["rounds_objects"], record.rank_groups)
        return
    print_status(console, record, view, n_events, supervised=record.ended or launcher_alive(record))


def _follow_run(handle) -> None:
    """`status --follow`: the run's events and live progress (`diloco.api.Run.follow`) until it ends."""
    from .observe.display import ProgressPrinter

    record = handle.record
    printer = ProgressPrinter(record)
    try:
        for record in handle.follow():
            printer.record = record
            printer()
        printer()  # events logged as the run ended, after its final record
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
    if follow:
        if len(handles) != 1:
            raise UserError("--follow needs one replica: add --rank R")
        for text in handle.follow_logs(handles[0].rank, attempt=attempt, lines=n_lines):
            click.echo(text, nl=False)
        return
    executor = handle.executor()
    for h in handles:
        if len(handles) > 1:
            click.echo(f"==> rank {h.rank} attempt {h.attempt} <==")
        click.echo(executor.stream_logs(h, n_lines=n_lines), nl=False)


@main.command()
@click.argument("run_id", metavar="RUN")
def cancel(run_id: str) -> None:
    """Stop every replica of a run (idempotent), from any shell."""
    from . import api

    handle = api.attach(run_id)
    n = handle.cancel()
    click.echo(f"cancelled run {handle.id} ({n} replicas)")


@main.command()
@click.argument("run_id", metavar="RUN")
@click.argument("replicas", type=int)
@click.option("--group", default=None, help="The group to resize (a run with [[group]] tables).")
def scale(run_id: str, replicas: int, group: str | None) -> None:
    """Grow or shrink a running run to REPLICAS replicas (per group with --group), from any shell."""
    from . import api

    out = api.attach(run_id).scale(replicas, group=group)
    what = f"group {out['group']} to {out['replicas']}" if out["group"] else f"{out['replicas']} replicas"
    if out["applied_by"] == "launcher":
        click.echo(f"run {out['run']}: scale to {what} requested; its launcher applies it within seconds "
                   f"(a `scaled` event; new replicas join at the next round, retired ones leave after theirs)")
    else:
        click.echo(f"run {out['run']}: scale to {what} recorded; no launcher supervises the run now: "
                   f"`diloco resume {out['run']}` applies it")


@main.command()
@click.argument("run_id", metavar="RUN")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Directory to write model.safetensors into (created if missing; an existing file is kept).")
@click.option("--round", "round_", type=click.IntRange(min=0), default=None,
              help="The checkpoint of this round (default: the newest; the last round once training ended).")
@click.option("--store", default=None, metavar="URI",
              help="The run's rendezvous URI, from a shell that has no record of the run (default: its record's).")
def export(run_id: str, out_dir: str, round_: int | None, store: str | None) -> None:
    """Write a run's global model as named tensors (safetensors), from any shell that reaches its store."""
    from . import api
    from .observe.exporting import export_model

    out = export_model(run_id, out_dir, round_=round_, store=store) if store else \
        api.attach(run_id).export(out_dir, round_=round_)
    click.echo(f"run {out['run']}: round {out['round']} written to {out['path']} ({out['tensors']} tensors, "
               f"{out['parameters']:,} parameters, theta digest {out['theta_digest']})")
    if out.get("config"):  # the run's trainer integration stored the model's configuration
        click.echo(f"with the model's configuration, {out['config']}: the directory loads with from_pretrained")


@main.command(name="list")
@click.option("--limit", default=20, show_default=True)
def list_runs(limit: int) -> None:
    """List recorded runs, newest first."""
    from rich.console import Console

    from . import api
    from .observe.display import runs_table

    Console(width=140, highlight=False).print(runs_table(api.runs(limit)))


if __name__ == "__main__":
    main()
