"""Where runs are recorded, and how: one directory per run under the state directory.

`runs/<run_id>/run.json` holds the spec (secrets never included), the backend, the handles of
every attempt and the run's status; `events.jsonl` is the append-only event log. Every write
of run.json is atomic (temp file + rename), so a launcher killed mid-write leaves the previous
record intact and `diloco status` from another shell never reads half a file. What a crash of
the machine or a full disk leaves is read back all the same: run.json checked once as it is read
(`diloco.runrecord.rundoc`: `DamagedRecord` names the file), events.jsonl line by line (`diloco.runrecord.eventlog`: what
is not an event is skipped).

Records may hold what a run's user alone should read (entrypoint args, rendezvous, errors):
the state directory is created 0700 and every file in it 0600. A run id names a directory in
it and nothing else (`check_run_id`): a path, a glob or an empty string is refused in one line,
and a prefix matches literally. Records hold valid JSON only: a non-finite number (a NaN loss)
is written as the string "nan"/"inf"/"-inf".
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import DamagedRecord, RunNotFound, UserError
from .eventlog import event_of
from ..records import from_record
from .rundoc import LauncherBeat, read_run_document
from ..host.statedir import private_dir, private_file, state_dir, to_json, write_json_atomic


# A run in one of these states has ended: nothing will change its record again.
FINAL_STATES = ("SUCCEEDED", "FAILED", "STOPPED")


RUN_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


def check_run_id(text: str, *, prefix: bool = False) -> str:
    """`text` if it can name a run (or, with `prefix`, begin a run id), else RunNotFound in one line."""
    if not isinstance(text, str) or not RUN_ID.match(text):
        shown = repr(text) if isinstance(text, str) and len(text) <= 80 else "the given id"
        what = "a run id or the start of one" if prefix else "a run id"
        raise RunNotFound(f"{shown} is not {what}: run ids are lowercase letters, digits and '-', at most 63 "
                          f"characters (`diloco list` shows them)")
    return text


def new_run_id(name: str) -> str:
    """`<slug>-<UTC time>-<16 hex>`: at most 63 characters, a valid DNS label, and 64 random bits,
    so two launches of one spec in the same second never share an id (16 bits did, 1 in 65,536)."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "run"
    if not slug[0].isalpha():
        slug = "r-" + slug
    slug = slug[:30].rstrip("-")
    return f"{slug}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(8)}"


class RunRecord:
    """The durable record of one run. `data` is the JSON document (`save()` persists it); the
    properties below are its typed views, which everything outside the supervisor reads."""

    def __init__(self, run_id: str, data: dict[str, Any], root: Path | None = None):
        self.run_id = run_id
        self.data = data
        self.dir = (root or state_dir()) / "runs" / run_id

    @property
    def path(self) -> Path:
        return self.dir / "run.json"

    # -- typed views of `data` ---------------------------------------------------------------

    @property
    def state(self) -> str:
        """INIT, HEALTHY, UNHEALTHY, or one of FINAL_STATES."""
        return str(self.data.get("state", "UNKNOWN"))

    @property
    def ended(self) -> bool:
        return self.state in FINAL_STATES

    @property
    def failure(self) -> str | None:
        return self.data.get("failure")

    @property
    def stopped_because(self) -> str | None:
        """Why a STOPPED run stopped when no `diloco cancel` asked (every replica cancelled outside diloco)."""
        return self.data.get("stopped_because")

    @property
    def spec(self) -> Any:
        """The `diloco.spec.runspec.RunSpec` the run was started from (secrets named, never valued)."""
        from ..spec.runspec import RunSpec

        if not isinstance(self.data.get("spec"), dict):  # a record the launcher wrote always has one
            raise DamagedRecord(f"{self.path} holds no spec; it was not written by `diloco run`, or was damaged")
        return from_record(RunSpec, self.data["spec"], where="run.json.spec")

    @property
    def rank_groups(self) -> dict[int, str]:
        """Rank → its group's name, for a run with [[group]] tables; empty otherwise (`diloco.spec.groups`)."""
        from ..spec.groups import rank_groups

        groups = rank_groups(self.data.get("spec"))
        if groups:  # ranks added by `diloco scale` to a group
            groups.update({int(r): str(g) for r, g in (self.data.get("scaled_ranks") or {}).items()})
        return groups

    @property
    def launch(self) -> dict[str, Any]:
        """The first launch's `diloco.request.LaunchRequest.to_dict()` (no secret values)."""
        return dict(self.data.get("launch") or {})

    @property
    def rendezvous(self) -> str | None:
        return self.launch.get("rendezvous")

    @property
    def n_replicas(self) -> int:
        return int(self.launch.get("n_replicas") or 0)

    @property
    def ranks(self) -> list[Any]:
        """Each rank's `diloco.runrecord.rankstate.RankState`."""
        from .rankstate import RankState

        return [RankState.from_dict(r) for r in self.data.get("ranks") or []]

    @property
    def handles(self) -> list[Any]:
        """The current attempt's handle of every rank that has one."""
        return [r.handle for r in self.ranks if r.handle is not None]

    @property
    def launcher(self) -> LauncherBeat:
        return LauncherBeat.from_dict(self.data.get("launcher"))

    @property
    def updated_at(self) -> float:
        return float(self.data.get("updated_at") or 0)

    def mark_stopped(self, **why: Any) -> None:
        """A run whose launcher is gone, cancelled from another shell: STOPPED, saved, an event."""
        self.data["state"] = "STOPPED"
        self.save()
        self.event("run_cancelled", **why)

    @property
    def events_path(self) -> Path:
        return self.dir / "events.jsonl"

    @property
    def cancel_marker(self) -> Path:
        return self.dir / "cancel-requested"

    def request_cancel(self) -> None:
        """Tell whichever launcher supervises this run to stop it (works across processes)."""
        private_dir(self.dir)
        self.cancel_marker.touch(mode=0o600)

    def cancel_requested(self) -> bool:
        return self.cancel_marker.exists()

    def save(self) -> None:
        self.data["updated_at"] = time.time()
        write_json_atomic(self.path, self.data)

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Append one event to the run's log (one JSON object a line, flushed at once)."""
        entry = {"t": time.time(), "event": kind, **fields}
        with private_file(self.events_path, "a") as f:
            f.write(to_json(entry, sort_keys=True) + "\n")
        return entry

    def events(self) -> list[dict[str, Any]]:
        return self.events_after(0)[0]

    def events_after(self, offset: int) -> tuple[list[dict[str, Any]], int]:
        """Events appended since byte `offset`, and the offset to continue from.

        Followers (the progress printer) read only what is new instead of the whole log each tick;
        a last line still being written is left for the next call.
        """
        try:
            with open(self.events_path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            return [], offset
        complete = data[: data.rfind(b"\n") + 1]
        return [e for e in map(event_of, complete.splitlines()) if e is not None], offset + len(complete)

    @classmethod
    def create(cls, run_id: str, data: dict[str, Any], root: Path | None = None) -> RunRecord:
        """A new record; create-only: an id already recorded is refused, never overwritten."""
        record = cls(check_run_id(run_id), {"run_id": run_id, "created_at": time.time(), **data}, root)
        private_dir(record.dir.parent)
        try:
            record.dir.mkdir(mode=0o700)
        except FileExistsError:
            raise UserError(f"run {run_id!r} is already recorded in {record.dir.parent}; launch again for a new "
                            f"run id") from None
        record.save()
        return record

    @classmethod
    def load(cls, run_id: str, root: Path | None = None) -> RunRecord:
        base = root or state_dir()
        path = base / "runs" / check_run_id(run_id, prefix=True) / "run.json"
        if not path.exists():
            runs = base / "runs"
            matches = [p.name for p in runs.iterdir() if p.name.startswith(run_id)] if runs.is_dir() else []
            if len(matches) == 1:
                return cls.load(matches[0], root)
            hint = f"; did you mean one of {', '.join(sorted(matches)[:5])}?" if matches else \
                "; `diloco list` shows the recorded runs"
            raise RunNotFound(f"no run {run_id!r} in {base / 'runs'}{hint}")
        return cls(run_id, read_run_document(path), base)


def iter_run_ids(root: Path | None = None) -> Iterator[str]:
    """The ids of the recorded runs, newest first: those whose run.json is damaged too (reading
    one raises `DamagedRecord`, which `diloco list` shows in its row)."""
    base = (root or state_dir()) / "runs"
    if not base.is_dir():
        return
    for d in sorted(base.iterdir(), key=lambda x: x.stat().st_mtime, reverse=True):
        if RUN_ID.match(d.name) and (d / "run.json").is_file():
            yield d.name
