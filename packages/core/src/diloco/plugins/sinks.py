"""Metric sinks: where the launcher writes each round's metrics besides its own records.

A sink is the second plugin kind (the first is an executor). A package registers sink classes
through the `diloco_register_metric_sinks` hook, and a spec picks them by name::

    [metrics]
    sinks = ["tensorboard", "mlflow"]      # default: ["tensorboard"] when tensorboardX is installed
    [metrics.mlflow]                        # options for one sink: keyword arguments of its class
    tracking_uri = "http://mlflow:5000"

A sink class has ``sink_name``, ``__init__(run_id, run_dir, **options)``, ``write(summary)`` for
each new `diloco.store.metrics.RoundSummary` (in round order, once each, also across `diloco resume`)
and ``close()``. Sinks run in the launcher; one that raises is reported once as a
``sink_failed`` event and dropped, never failing the run. Built in: only what works offline,
``tensorboard`` (event files under the run's records, ``<records>/tensorboard``), which needs
``pip install 'diloco-core[tensorboard]'`` (tensorboardX pulls numpy, which diloco-core alone
never does). With no ``sinks`` in the spec, it is on when installed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, ClassVar

from ..errors import SpecError
from ..store.metrics import PHASES, RoundSummary



def scalars(summary: RoundSummary) -> dict[str, float]:
    """The round's numbers, by tag: what every built-in sink writes."""
    members = [r for r in summary.rows if r.member]
    out: dict[str, float] = {"round/members": float(len(summary.members)),
                             "round/bytes_up": float(summary.bytes_up), "round/bytes_down": float(summary.bytes_down),
                             "round/waited_for_straggler_s": float(summary.waited_s)}
    for name, value in (("train/loss", summary.loss), ("train/tokens_per_s", summary.tokens_per_s),
                        ("round/sync_share", summary.sync_share)):
        if value is not None:
            out[name] = float(value)
    if members:
        for phase in PHASES:
            out[f"timeline/{phase}_s"] = sum(r.phases.get(phase, 0.0) for r in members) / len(members)
        out["timeline/hidden_s"] = sum(r.hidden_s for r in members) / len(members)
    return out


class TensorBoardSink:
    """TensorBoard event files in the run's records (`tensorboard --logdir <records>/tensorboard`)."""

    sink_name: ClassVar[str] = "tensorboard"
    install_hint: ClassVar[str] = "pip install 'diloco-core[tensorboard]'"

    @staticmethod
    def installed() -> bool:
        import importlib.util

        return importlib.util.find_spec("tensorboardX") is not None

    def __init__(self, run_id: str, run_dir: Path, *, logdir: str | None = None):
        self.logdir = Path(logdir) if logdir else run_dir / "tensorboard"
        # tensorboardX imports torch at import when it can (seconds, hundreds of MB in the launcher);
        # scalars need none of it, so it is imported with torch hidden. This runs on the sink thread
        # (diloco.runrecord.sinkwriter) beside the supervisor's: nothing there may look torch up in
        # sys.modules meanwhile (the local executor learns whether torchrun can start once, when built).
        hidden = "torch" not in sys.modules
        if hidden:
            sys.modules["torch"] = None  # type: ignore[assignment]
        try:
            from tensorboardX import SummaryWriter
        finally:
            if hidden:
                del sys.modules["torch"]
        if not logdir:  # in the run's records: private like them (a directory the user named is theirs)
            from ..host.statedir import private_dir

            private_dir(self.logdir)
        self.writer = SummaryWriter(str(self.logdir), flush_secs=5)
        if not logdir:  # tensorboardX creates its event file at once, with open(): 0644
            for path in self.logdir.iterdir():
                path.chmod(0o600)

    def write(self, summary: RoundSummary) -> None:
        step = summary.step or summary.round
        wall = summary.t or None
        for tag, value in scalars(summary).items():
            self.writer.add_scalar(tag, value, step, walltime=wall)
        for eval_step, loss in summary.evals:
            self.writer.add_scalar("eval/loss", loss, int(eval_step), walltime=wall)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def available() -> dict[str, type]:
    """Installed sinks by name (the built-in one and every plugin's)."""
    from .discovery import get_plugin_manager

    found: dict[str, type] = {}
    for classes in get_plugin_manager().hook.diloco_register_metric_sinks():
        for cls in classes or []:
            found[getattr(cls, "sink_name", cls.__name__)] = cls
    return found


def check_metrics(where: str, table: dict[str, Any]) -> dict[str, Any]:
    """The spec's [metrics] table: `sinks` (names) plus one options table per sink."""
    sinks = table.get("sinks")
    if sinks is not None and (not isinstance(sinks, list) or not all(isinstance(s, str) and s for s in sinks)):
        raise SpecError(f"{where}: `metrics.sinks` must be an array of sink names, e.g. sinks = [\"tensorboard\"]")
    for key, value in table.items():
        if key == "sinks":
            continue
        if key not in (sinks or []):
            raise SpecError(f"{where}: [metrics.{key}] configures a sink not in `metrics.sinks` ({sinks or []})")
        if not isinstance(value, dict):
            raise SpecError(f"{where}: `metrics.{key}` must be a table of that sink's options")
    return {"sinks": sinks, **{k: v for k, v in table.items() if k != "sinks"}}


def chosen(metrics: dict[str, Any]) -> list[str]:
    """The sinks a spec's [metrics] picks; without `sinks`, every built-in one whose library is here."""
    if metrics.get("sinks") is not None:
        return list(metrics["sinks"])
    return [TensorBoardSink.sink_name] if TensorBoardSink.installed() else []


def check_sinks_installed(metrics: dict[str, Any], where: str = "spec") -> None:
    """Every sink the spec names is installed (checked before a run is recorded)."""
    found = available()
    for name in chosen(metrics):
        if name not in found:
            raise SpecError(f"{where}: metric sink {name!r} is not installed (installed: "
                            f"{', '.join(sorted(found)) or 'none'}); a sink is a package registering "
                            f"`diloco_register_metric_sinks`")
        installed = getattr(found[name], "installed", None)
        if installed is not None and not installed():
            raise SpecError(f"{where}: metric sink {name!r} needs its library: {found[name].install_hint}")


def open_sinks(metrics: dict[str, Any], run_id: str, run_dir: Path, *, where: str = "spec") -> list[Any]:
    """Instantiate the spec's sinks; an unknown name or option is a one-line `SpecError`."""
    check_sinks_installed(metrics, where)
    found = available()
    out = []
    for name in chosen(metrics):
        try:
            out.append(found[name](run_id, run_dir, **metrics.get(name, {})))
        except TypeError as exc:
            raise SpecError(f"{where}: [metrics.{name}]: {exc}") from None
    return out
