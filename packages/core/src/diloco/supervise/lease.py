"""One supervisor per run: a create-only lease file with a heartbeat, taken over only once expired.

Two supervisors of one run each relaunch "missing" ranks, so a run gets two live rank-0
replicas, and `cancel` reaches only the one in the record. Checking run.json's heartbeat before
resuming did not prevent it: two `diloco resume` started together both saw a dead launcher.
So `diloco run`, `diloco resume` and the Python API's `supervise()` each take the run's lease,
`runs/<id>/supervisor.lease`, before they touch a replica:

- **Taking it** is `open(O_CREAT | O_EXCL)`: of any number of racers exactly one creates it.
- **Holding it** is a daemon thread touching the file every `RENEW_EVERY` seconds, which also
  checks the file still names this holder; if another took it (after this process stalled past
  `TTL`), `lost` is set and the supervisor stops instead of fighting.
- **Taking over** is allowed only from a holder that is gone: on this host its process is
  dead (pid and start time, so a recycled pid does not count as alive); from another host, its
  file has not been touched for `TTL` seconds. A takeover is serialised by a second create-only
  file, so two racers cannot both replace an expired lease.

Clocks: expiry compares the file's mtime (set by the filesystem holding the state dir) with
this host's clock, so hosts sharing a state dir must keep their clocks within `TTL` of it.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import UserError
from ..host.procinfo import is_running, started_at

TTL = 30.0          # a lease untouched this long, held from another host, is expired
RENEW_EVERY = 5.0   # how often the holder touches it
LEASE_FILE = "supervisor.lease"
TAKEOVER_WAIT = 10.0  # how long a racer waits for another's takeover to finish


class LeaseHeld(UserError):
    """Another live process supervises the run."""


@dataclass(frozen=True)
class LeaseHolder:
    """Who holds a run's lease, as the file says."""

    pid: int
    host: str
    started: float | None
    token: str
    taken_at: float

    @classmethod
    def here(cls) -> LeaseHolder:
        return cls(os.getpid(), socket.gethostname(), started_at(os.getpid()), secrets.token_hex(16),
                   time.time())

    @classmethod
    def read(cls, path: Path) -> tuple[LeaseHolder | None, float | None]:
        """The holder and the file's mtime; (None, mtime) for a file still being written or
        unreadable (it then counts as held until it is `TTL` old); (None, None) if absent."""
        try:
            mtime = path.stat().st_mtime
            data = json.loads(path.read_text())
            holder = cls(int(data["pid"]), str(data["host"]), data.get("started"), str(data["token"]),
                         float(data["taken_at"]))
        except FileNotFoundError:
            return None, None
        except (OSError, ValueError, KeyError, TypeError):
            try:
                return None, path.stat().st_mtime
            except FileNotFoundError:
                return None, None
        return holder, mtime

    def alive(self, mtime: float, now: float) -> bool:
        """Whether this holder still supervises: on this host its process decides; elsewhere the
        heartbeat (the file's mtime) must be younger than `TTL`."""
        if self.host == socket.gethostname():
            return is_running(self.pid, self.started)
        return now - mtime <= TTL

    def describe(self, mtime: float | None) -> str:
        age = f", renewed {max(0.0, time.time() - mtime):.0f} s ago" if mtime else ""
        return f"process {self.pid} on {self.host}{age}"


class SupervisorLease:
    """The held lease of one run directory; `release()` (or the context manager) gives it back."""

    def __init__(self, path: Path, holder: LeaseHolder):
        self.path = path
        self.holder = holder
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name=f"lease-{path.parent.name}", daemon=True)
        self._thread.start()

    @classmethod
    def acquire(cls, run_dir: Path, *, run_id: str | None = None) -> SupervisorLease:
        """Take the run's lease, or raise `LeaseHeld` in one line naming the holder."""
        path = run_dir / LEASE_FILE
        me = LeaseHolder.here()
        if _create(path, me):
            return cls(path, me)
        holder, mtime = LeaseHolder.read(path)
        now = time.time()
        if _held(holder, mtime, now):
            raise _refusal(run_id or run_dir.name, holder, mtime)
        return cls(_take_over(path, me), me)

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_EVERY):
            holder, _ = LeaseHolder.read(self.path)
            if holder is None or holder.token != self.holder.token:
                self.lost = True
                return
            try:
                os.utime(self.path)
            except FileNotFoundError:
                self.lost = True
                return

    def release(self) -> None:
        """Stop renewing and remove the file, if it still names this holder."""
        self._stop.set()
        holder, _ = LeaseHolder.read(self.path)
        if holder is not None and holder.token == self.holder.token:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass

    def __enter__(self) -> SupervisorLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def current_holder(run_dir: Path) -> LeaseHolder | None:
    """The live holder of a run's lease, or None (no lease, or an expired one)."""
    holder, mtime = LeaseHolder.read(run_dir / LEASE_FILE)
    return holder if holder is not None and holder.alive(mtime or 0.0, time.time()) else None


def _held(holder: LeaseHolder | None, mtime: float | None, now: float) -> bool:
    if mtime is None:
        return False  # gone since we tried to create it
    if holder is None:
        return now - mtime <= TTL  # being written, or garbage: held until it is old
    return holder.alive(mtime, now)


def _refusal(run_id: str, holder: LeaseHolder | None, mtime: float | None) -> LeaseHeld:
    who = holder.describe(mtime) if holder else "another process (its lease is being written)"
    return LeaseHeld(f"run {run_id} is already supervised by {who}; stop that launcher first (diloco cancel "
                     f"{run_id} stops the run), or wait for it to end")


def _create(path: Path, holder: LeaseHolder) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(asdict(holder)))
    return True


def _take_over(path: Path, me: LeaseHolder) -> Path:
    """Replace an expired lease, one racer at a time (a create-only `.takeover` file).

    A racer that finds another mid-takeover waits for it (a takeover is a read and a rename,
    milliseconds) and then refuses naming the new holder, as if it had come second outright."""
    guard = path.with_name(path.name + ".takeover")
    deadline = time.monotonic() + TAKEOVER_WAIT
    while True:
        try:
            fd = os.open(guard, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.close(fd)
            break
        except FileExistsError:
            pass
        try:
            if time.time() - guard.stat().st_mtime > TTL:  # a taker that died mid-takeover
                guard.unlink()
                continue
        except FileNotFoundError:
            continue
        holder, mtime = LeaseHolder.read(path)
        if holder is not None and holder.token != me.token and _held(holder, mtime, time.time()):
            raise _refusal(path.parent.name, holder, mtime)
        if time.monotonic() > deadline:
            raise LeaseHeld(f"run {path.parent.name} is being taken over by another launcher right now; "
                            f"`diloco status {path.parent.name}` shows which")
        time.sleep(0.02)
    try:
        holder, mtime = LeaseHolder.read(path)
        if not _held(holder, mtime, time.time()):
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(asdict(me)))
            os.replace(tmp, path)
            return path
        raise _refusal(path.parent.name, holder, mtime)
    finally:
        try:
            guard.unlink()
        except FileNotFoundError:
            pass
