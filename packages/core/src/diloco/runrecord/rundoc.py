"""run.json as read back: the fields every reader of a run's record relies on, with their types,
checked once when the file is read (`read_run_document`).

The launcher writes run.json atomically, but a file can still come back damaged: a disk that
filled, a crash of the machine (not the process) before the rename reached the disk, a hand edit.
Every command that reads it (`status`, `logs`, `resume`, `list`, the Python API) then needs one
answer: `DamagedRecord`, a line that names the file and the first thing wrong with it, instead of
whichever attribute or key error the first reader of a bad field would meet. Fields the readers
take as they are (the launch request, round health, applied scales) are checked for their shape
only; the ranks, the launcher's heartbeat and the spec are decoded as the records they are.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import DamagedRecord
from .eventlog import LATEST_T
from .rankstate import RankState
from ..records import RecordError, from_record


@dataclass(frozen=True)
class LauncherBeat:
    """Which process supervises the run, and when it last said so (`launcher` in run.json)."""

    pid: int | None = None
    host: str | None = None
    heartbeat: float = 0.0
    started: float | None = None  # the process's creation time (diloco.host.procinfo)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> LauncherBeat:
        return from_record(cls, data or {}, where="the launcher's heartbeat")


@dataclass(frozen=True)
class RunDocument:
    """The top-level fields of run.json (`diloco.runrecord.state.RunRecord` keeps the document itself)."""

    run_id: str | None = None
    state: str = "UNKNOWN"
    backend: str | None = None
    created_at: float = 0.0
    updated_at: float = 0.0
    failure: str | None = None
    stopped_because: str | None = None
    spec: dict[str, Any] | None = None
    launch: dict[str, Any] | None = None
    ranks: list[RankState] = field(default_factory=list)
    launcher: LauncherBeat | None = None
    policy: str | None = None
    restarts_used: int = 0
    preemptions_used: int = 0
    target_replicas: int | None = None
    last_round: int | None = None
    health: dict[str, Any] | None = None
    applied_scales: list[Any] | None = None
    scaled_ranks: dict[str, str] | None = None


def read_run_document(path: Path) -> dict[str, Any]:
    """run.json's document, every field of `RunDocument` (and the spec) checked; `DamagedRecord`
    naming `path` otherwise."""
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise _damaged(path, "it is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise _damaged(path, "it is empty" if not exc.doc.strip() else f"it is not whole JSON ({exc.msg} at "
                             f"line {exc.lineno} column {exc.colno})") from None
    except RecursionError:
        raise _damaged(path, "it is nested deeper than JSON is read") from None
    try:
        doc = from_record(RunDocument, data, where="run.json")
        if doc.spec is not None:
            from ..spec.runspec import RunSpec

            from_record(RunSpec, doc.spec, where="run.json.spec")
    except RecordError as exc:
        raise _damaged(path, str(exc)) from None
    for name in ("created_at", "updated_at"):  # shown as dates
        if not 0 <= getattr(doc, name) <= LATEST_T:
            raise _damaged(path, f"run.json.{name} is not a time: {getattr(doc, name)!r}")
    return data


def _damaged(path: Path, what: str) -> DamagedRecord:
    return DamagedRecord(f"{path} is damaged: {what}; the launcher that wrote it may have crashed or its disk "
                         f"filled. Other runs are unaffected (`diloco list`); this one's replicas, if any still "
                         f"run, are found with their backend's own tools")
