"""diloco from Python: launch a run from a spec, follow it, and attach to it from anywhere.

For notebooks and sweep scripts, with the CLI's powers; the CLI is built on this module::

    import diloco

    run = diloco.launch("examples/tiny-lm/diloco.toml")        # or a dict shaped like the TOML
    run.wait()                                                 # "SUCCEEDED" (RunFailed if it failed)
    run.rounds()[-1].members, run.results()

    same = diloco.attach(run.id)                               # from another process or machine's shell
    same.progress().step, same.logs(rank=0), same.scale(8), same.cancel()
    for record in same.follow(): print(record.state)           # until it ends, as `diloco status --follow`
    for text in same.follow_logs(rank=0): print(text, end="")  # as `diloco logs --rank 0 --follow`

A `Run` holds no state of its own: every method reads the run's record (run.json, events.jsonl
under the state dir), its object store (round metrics), or its backend (live statuses, logs), so
a `Run` from `attach` in another process sees exactly what the launching one does.

`launch` supervises in a background thread of this process and returns once the replicas are
launched; if this process ends first (a notebook kernel restarted), the replicas keep running
and `diloco resume RUN` (or `attach(id).supervise()`) takes supervision over. `supervise()`
runs it in the calling thread instead, as `diloco run` does.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .errors import UserError
from .observe.liveness import launcher_alive, live_statuses, per_group
from .runrecord.state import FINAL_STATES, RunRecord


def load(spec: str | Path | Mapping[str, Any], *, base_dir: str | Path | None = None) -> Any:
    """A `RunSpec` from a spec file's path or from a dict shaped like the TOML (relative paths in
    it resolve against `base_dir`, default the working directory)."""
    from .spec.runspec import RunSpec, load_spec, parse_spec

    if isinstance(spec, RunSpec):  # built in Python, not parsed: checked as a parsed one is
        return parse_spec(spec.to_table(), source=spec.source, base_dir=Path(base_dir) if base_dir else None)
    if isinstance(spec, Mapping):
        return parse_spec(spec, source="<spec dict>", base_dir=Path(base_dir) if base_dir else None)
    return load_spec(spec)


def launch(spec: str | Path | Mapping[str, Any], *, base_dir: str | Path | None = None,
           background: bool = True) -> Run:
    """Validate the spec, record the run and (with `background`) launch and supervise it in a
    daemon thread; returns once the replicas are launched. `background=False` only records the
    run: call `supervise()` to launch and supervise in the calling thread."""
    from .launching.launcher import new_run

    sup = new_run(load(spec, base_dir=base_dir))
    run = Run(sup.record.run_id, root=sup.record.dir.parent.parent)
    run.supervisor = sup
    if background:
        sup.take_lease()  # held before any replica starts; the supervising thread keeps and releases it
        try:
            sup.start()  # launch errors surface here, in the caller's thread
        except BaseException:
            sup.release_lease()
            raise
        run._thread = threading.Thread(target=run._supervise_quietly, name=f"diloco-{run.id}", daemon=True)
        run._thread.start()
    return run


def attach(run_id: str) -> Run:
    """The run with this id (a unique prefix is enough), as recorded under the state dir."""
    return Run(RunRecord.load(run_id).run_id)


def runs(limit: int | None = None) -> list[Run]:
    """Recorded runs, newest first; a run whose run.json is damaged too (reading its `record` or
    `state` raises `diloco.errors.DamagedRecord`, which `diloco list` shows in its row)."""
    from .runrecord.state import iter_run_ids

    out = []
    for run_id in iter_run_ids():
        if limit is not None and len(out) >= limit:
            break
        out.append(Run(run_id))
    return out


class Run:
    """One recorded run; see the module docstring."""

    def __init__(self, run_id: str, *, root: Path | None = None):
        self.id = run_id
        self._root = root
        self.supervisor: Any = None  # set when this process launched or took over the run
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def __repr__(self) -> str:
        return f"<diloco.Run {self.id} {self.state}>"

    # -- the record ---------------------------------------------------------------------------

    @property
    def record(self) -> RunRecord:
        """The run's record, re-read (another process may be supervising it)."""
        if self.supervisor is not None:
            return self.supervisor.record
        return RunRecord.load(self.id, self._root)

    @property
    def state(self) -> str:
        """INIT, HEALTHY, UNHEALTHY, or one of the final states SUCCEEDED, FAILED, STOPPED."""
        return self.record.state

    @property
    def spec(self) -> Any:
        return self.record.spec

    @property
    def done(self) -> bool:
        return self.state in FINAL_STATES

    def ranks(self) -> list[Any]:
        """Each rank's `diloco.runrecord.rankstate.RankState`: status, attempt handle, restarts, last error, result,
        and (in a run with [[group]] tables) `group`, the name of the group it runs in."""
        return self.record.ranks

    def results(self) -> list[Any]:
        """What each rank's entrypoint returned (JSON data; None where a rank returned nothing or failed)."""
        return [r.result for r in self.ranks()]

    def events(self) -> list[dict[str, Any]]:
        return self.record.events()

    def rounds(self) -> list[Any]:
        """Each completed round's `diloco.store.metrics.RoundSummary`, read from the run's store."""
        return self._rounds_of(self.record)

    @staticmethod
    def _rounds_of(record: RunRecord) -> list[Any]:
        from .store.metrics import read_rounds

        return read_rounds(record.rendezvous, record.run_id, cache_dir=record.dir, final=record.ended)

    def progress(self) -> Any:
        """`diloco.observe.progress.Progress`: global step / total, round, rate, ETA, members, restarts."""
        from .observe.progress import progress_of

        record = self.record
        return progress_of(record.data, record.events(), time.time())

    def supervised(self) -> bool:
        """Whether some launcher process still supervises the run (see `launcher_alive`)."""
        return launcher_alive(self.record)

    # -- the backend --------------------------------------------------------------------------

    def executor(self) -> Any:
        from .launching.launcher import executor_for

        return executor_for(self.record)

    def handles(self) -> list[Any]:
        """The current attempt's handle of every rank that has one."""
        return self._handles_of(self.record)

    @staticmethod
    def _handles_of(record: RunRecord) -> list[Any]:
        return record.handles

    def groups(self) -> list[Any]:
        """The run's `diloco.spec.groups.ReplicaGroup`s: name, backend, ranks (one group for a spec without them)."""
        return self.record.spec.replica_groups()

    def live(self) -> dict[int, str]:
        """Each rank's status as its backend reports it now (ranks whose backend cannot be reached
        from this shell are left out; `status()['live_error']` says why)."""
        return live_statuses(self.record)[0]

    def log_handles(self, rank: int | None = None, attempt: int | None = None) -> list[Any]:
        """The handle whose output `logs` reads, for each chosen rank (latest attempt by default)."""
        from .protocol import ReplicaHandle

        ranks = self.record.ranks
        if rank is not None and not any(r.rank == rank for r in ranks):
            raise UserError(f"run {self.id} has no rank {rank} (ranks 0..{len(ranks) - 1})")
        handles = []
        for r in ranks:
            if rank is not None and r.rank != rank:
                continue
            history = [ReplicaHandle.from_dict(h) for h in r.attempts]
            if attempt is not None:
                history = [h for h in history if h.attempt == attempt]
                if not history:
                    raise UserError(f"rank {r.rank} has no attempt {attempt}")
            if history:
                handles.append(history[-1])
        return handles

    def logs(self, rank: int | None = None, *, attempt: int | None = None, lines: int = 200) -> dict[int, str]:
        """The last `lines` of output of each chosen rank's attempt, by rank."""
        executor = self.executor()
        return {h.rank: executor.stream_logs(h, n_lines=lines) for h in self.log_handles(rank, attempt)}

    def follow_logs(self, rank: int | None = None, *, attempt: int | None = None, lines: int = 200) -> Iterator[str]:
        """One rank's last `lines` of output (latest attempt by default; `rank` may be left out
        in a run of one replica), then what it prints, chunk by chunk, until the replica ends:
        what `diloco logs --follow` prints."""
        from .observe.follow import follow_output

        handles = self.log_handles(rank, attempt)
        if len(handles) != 1:
            raise UserError(f"run {self.id}: {len(handles)} replicas match; follow_logs follows one (name its rank)")
        return follow_output(self.executor(), handles[0], lines=lines)

    def cancel(self) -> int:
        """Stop every replica (idempotent, from any process); returns how many were told to stop.

        The supervising launcher, if any, sees the request and records STOPPED; with none, the
        record is marked STOPPED here."""
        from .launching.launcher import executor_for

        record = self.record
        record.request_cancel()
        executor = executor_for(record)
        handles = self._handles_of(record)
        _, failed = per_group(record, executor.cancel)  # every handle that can be reached
        groups = record.rank_groups
        if failed:
            left = [h.rank for h in handles if groups.get(h.rank, "") in failed]
            first = next(iter(failed))
            raise UserError(f"run {self.id}: cancelled {len(handles) - len(left)} of {len(handles)} replicas; ranks "
                            f"{left} (group {', '.join(failed)}) could not be reached: {failed[first]}; run `diloco "
                            f"cancel {self.id}` again from a shell that has that backend")
        supervised_here = self._thread is not None and self._thread.is_alive()
        if not supervised_here and not launcher_alive(record) and not record.ended:
            record.mark_stopped(by="diloco cancel")
        return len(handles)

    def scale(self, replicas: int, *, group: str | None = None) -> dict[str, Any]:
        """Resize the running run (`diloco.store.scaling`): `group` (needed where it has several) to
        `replicas` replicas. Its launcher applies it, or `resume` does where none runs."""
        from .store.scaling import request_scale

        req = request_scale(self.record, replicas, group)
        by = "launcher" if self.supervisor is not None or launcher_alive(self.record) else "resume"
        return {"run": self.id, "group": req.group, "replicas": req.replicas, "request": req.name, "applied_by": by}

    def export(self, out: str | Path, *, round_: int | None = None) -> dict[str, Any]:
        """Write the run's global model to ``<out>/model.safetensors`` (`diloco.observe.exporting`): the
        newest complete checkpoint, or round `round_`'s. Returns what was written."""
        from .observe.exporting import export_model

        record = self.record
        return export_model(record.run_id, out, round_=round_, store=record.rendezvous or None)

    # -- supervision --------------------------------------------------------------------------

    def supervise(self, on_tick: Callable[[Any], None] | None = None) -> str:
        """Launch (if not yet launched) and supervise the run in this thread until it ends; take
        over a run whose launcher died. Returns the final state; raises RunFailed on failure."""
        from .launching.launcher import resume_run
        from .supervise.policy import RunState

        if self.supervisor is None:
            record = self.record
            if record.ended:
                raise UserError(f"run {self.id} already ended ({record.state}); nothing to resume")
            from .supervise.lease import LEASE_FILE

            # With a lease file the lease decides and its refusal names the live holder (run.json's
            # launcher is the one that died); records from before the lease have only the heartbeat.
            if not (record.dir / LEASE_FILE).exists() and launcher_alive(record):
                raise UserError(f"run {self.id} is still supervised by process {record.launcher.pid}; "
                                "stop that launcher first (or wait for it)")
            supervisor = resume_run(record)
            supervisor.take_lease()  # of two resumes started together, one supervises; the other stops here
            self.supervisor = supervisor
            record.event("resumed", pid=os.getpid())
        if on_tick is not None:
            self.supervisor.on_tick = on_tick
        return self.supervisor.run(start=self.supervisor.state is RunState.INIT).value

    def _supervise_quietly(self) -> None:
        try:
            self.supervisor.run(start=False)
        except BaseException as exc:  # RunFailed and anything else: `wait` re-raises it in the caller
            self._error = exc

    def follow(self, interval: float = 0.5) -> Iterator[RunRecord]:
        """Snapshots of the run until it ends, as `diloco status --follow` shows them from any
        process: its record re-read from disk every `interval` seconds, each a `RunRecord` of its
        own (`state`, `ranks`, `events_after(offset)` for what is new), the last one final.
        Raises UserError when no launcher supervises the run and its record has stopped changing:
        it would never end by itself (`diloco resume RUN` takes over). See `diloco.observe.follow`."""
        from .observe.follow import follow_record

        # from disk, not self.record: a supervisor in this process changes that one in place
        return follow_record(lambda: RunRecord.load(self.id, self._root), launcher_alive, interval=interval)

    def wait(self, timeout: float | None = None, *, poll: float = 1.0) -> str:
        """Block until the run ends; return its final state. Raises RunFailed if it failed,
        TimeoutError after `timeout` seconds. Works on attached runs too (it follows the record)."""
        from .supervise.supervisor import RunFailed

        deadline = None if timeout is None else time.monotonic() + timeout
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"run {self.id} still {self.state} after {timeout}s")
            if self._error is not None and not isinstance(self._error, RunFailed):
                raise self._error
        while not self.done:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"run {self.id} still {self.state} after {timeout}s")
            time.sleep(poll)
        record = self.record
        if record.state == "FAILED":
            raise RunFailed(record.failure or "run failed", {r.rank: r.last_error for r in record.ranks})
        return record.state

    # -- what `diloco status` shows ----------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """What `diloco status RUN --json` prints, as JSON-ready data: the record, each rank's live
        status (`live_error` says why there is none), events, rounds, progress, timeline rows,
        the estimate and the traffic the replicas counted."""
        out = self.view()
        out.pop("rounds_objects")
        return out

    def view(self) -> dict[str, Any]:
        """`status()` plus the rounds as `RoundSummary` objects (`rounds_objects`), for renderers."""
        from .spec.estimate import estimate_view
        from .observe.progress import progress_of, timeline_rows

        record = self.record  # read once: every part below describes the same moment
        try:
            live, live_error = live_statuses(record)
        except UserError as exc:  # the backend's SDK or credentials are missing in this shell
            live, live_error = {}, str(exc)
        rounds = self._rounds_of(record)
        events = record.events()
        return {"record": record.data, "live": live, "live_error": live_error, "events": events,
                "rounds": [asdict(r) for r in rounds], "rounds_objects": rounds,
                "progress": progress_of(record.data, events, time.time()).to_dict(),
                "timeline": timeline_rows(rounds, record.rank_groups),
                **estimate_view(record, rounds)}
