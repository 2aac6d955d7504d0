"""Where a replica's rounds run, as the training process sees it: a sync process, or a thread.

Both hold the same two host buffers (the lane's local snapshot and θ_global; mapped by both
processes through `sharedbuf` for a sync process) and
answer the same calls — `join`, `start` a round, whether it has `arrived`, its `outcome`,
`applied`, `settle`, `close` — around the same `exchanger.Exchanger`:

- `InThread` (`exchange = "thread"`, the default) runs it on a thread of the training process.
  Its host work holds the interpreter the training loop launches kernels from only for its
  Python parts (torch's operations release it); on an H100 host that slowed inner steps by 1%
  while a round was exchanged (bench/gpu_sync.py, docs/benchmarks.md). A store only this process
  can reach (`memory://`, or a store object handed to `DiLoCo(store=...)`) always uses it.
- `SyncProcess` (`exchange = "process"`) runs it in a process of its own (`syncproc`), so the
  round's host work never touches the training loop's interpreter. On the same host it slowed
  inner steps by 16% (most likely its threads competing with the training processes for the host's
  cores; not settled yet), so it is the choice where the interpreter, not the host, is what a
  round contends for.

A sync process that dies fails the replica with one line naming how it died; it never trains on
without one.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from multiprocessing.connection import Connection
from typing import Any, Callable

import torch

from diloco.bootstrap.context import ReplicaContext
from diloco.errors import UserError
from diloco.store.metrics import RoundMetrics
from diloco.records import from_record
from diloco.spec.settings import DilocoSettings

from . import sharedbuf
from .exchanger import Exchanger, Outcome, Work
from ..transport.finite import NonFinite
from ..round.lanes import Lanes, PeerLost
from ..round.layout import lane_range
from ..round.errors import FellBehind, RoundFailed
from ..round.streaming import LocalReader
from .syncwire import receive, send

# What the sync process's error kinds (`syncproc.crossing_kind`) are raised as here.
_RAISED: dict[str, type[Exception]] = {"UserError": UserError, "NonFinite": NonFinite, "FellBehind": FellBehind,
                                       "RoundFailed": RoundFailed}


def sync_threads(lanes: int) -> int:
    """torch threads of a sync process, unless DILOCO_SYNC_THREADS says: its work (decoding, folding,
    the outer step) is elementwise and memory-bound, so a few threads reach the memory's speed; more
    only take cores from the training processes, whose kernel launches must never wait for one
    (bench/gpu_sync.py's proxy on 2 cores: the reduce took 4.5 s a round with 2 threads, 1.9 s with
    one). A quarter of the cores per lane, 1 to 4."""
    return max(1, min(4, (os.cpu_count() or 1) // (4 * max(1, lanes))))


class InThread:
    """The rounds on one thread of this process (stores only this process can reach).

    `snapshot`: whether a round needs a host copy of the lane (an FSDP2 lane, whose values other
    processes hold); without one a round reads θ_local a slice at a time where it is
    (`streaming.LiveDelta`), and θ_0 is read into θ_global's buffer, which the join fills anyway.
    `device`: the model's, where a quantised transport's codec arithmetic runs (`codecdevice`)."""

    def __init__(self, ctx: ReplicaContext, settings: DilocoSettings, store: Any, total: int, lanes: Lanes,
                 log: Callable[[str], None], *, snapshot: bool, device: torch.device | None = None):
        numel = lane_numel(total, lanes)
        self.theta = torch.zeros(numel)
        self.snapshot = torch.zeros(numel) if snapshot else None
        self.exchanger = Exchanger(ctx, settings, store, total, lanes, log=log, theta_out=self.theta, device=device)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="diloco-round")
        self._future: Future | None = None

    def join(self, initial: bool) -> tuple[int, bool]:
        initial_buf = self.snapshot if self.snapshot is not None else self.theta
        return self.exchanger.join((lambda: initial_buf) if initial else None)  # the loop waits: no copy

    def start(self, r: int, work: Work, local: LocalReader | None = None) -> None:
        """Round r, from the snapshot, or from `local` where no snapshot is taken."""
        source = self.snapshot if local is None else local
        if source is None:
            raise ValueError("a round without a snapshot buffer reads θ_local through `local`")
        self._future = self._pool.submit(self.exchanger.run, r, source, work)

    def arrived(self) -> bool:
        return self._future is not None and self._future.done()

    def outcome(self) -> Outcome:
        future, self._future = self._future, None
        try:
            return future.result()
        except PeerLost as lost:
            lost.wait_to_be_stopped()

    def applied(self, r: int, **timings: float) -> None:
        self.exchanger.applied(r, **timings)

    def check(self) -> None:
        """Nothing to check: a thread cannot die alone."""

    def settle(self) -> None:
        self.exchanger.settle()

    def checkpoint_last(self) -> None:
        self.exchanger.checkpoint_last()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.exchanger.close()


class SyncProcess:
    """The rounds in a sync process of this training process's own (`syncproc`)."""

    def __init__(self, ctx: ReplicaContext, settings: DilocoSettings, total: int, lanes: Lanes,
                 log: Callable[[str], None], threads: int | None = None):
        self.log = log
        numel = lane_numel(total, lanes)
        theta_path, self.theta = sharedbuf.create(numel, "theta")
        snapshot_path, self.snapshot = sharedbuf.create(numel, "snapshot")
        self._meeting = None
        lanes_at = None
        if lanes.count > 1:  # the lanes' sync processes meet at a store lane 0's process holds (on node 0)
            if lanes.leader:
                from torch.distributed import TCPStore

                self._meeting = TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
                lanes_at = f"{os.environ.get('MASTER_ADDR') or '127.0.0.1'}:{self._meeting.port}"
            lanes_at = lanes.exchange(lanes_at)[0]
        ours, theirs = socket.socketpair()
        threads = threads or sync_threads(lanes.count)
        # idle OpenMP threads sleep rather than spin: they share the host with the training processes
        env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ}
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "diloco_replica.exchange.syncproc", str(theirs.fileno()),
                                          str(os.getpid())], pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                         env=env)
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self._in_flight = False
        try:
            self._send("start", total=total, theta=theta_path, snapshot=snapshot_path, lanes_at=lanes_at,
                 threads=threads, settings=asdict(settings),
                 ctx={"rank": ctx.rank, "world_size": ctx.world_size, "run_id": ctx.run_id, "attempt": ctx.attempt,
                      "rerun": ctx.rerun, "rendezvous": ctx.rendezvous, "lane": ctx.lane, "lanes": ctx.lanes})
            self._expect("mapped")
        finally:
            sharedbuf.unlink(theta_path)  # both map them now; no name is left behind, whoever dies
            sharedbuf.unlink(snapshot_path)

    # -- the requests ------------------------------------------------------------------------

    def join(self, initial: bool) -> tuple[int, bool]:
        self._send("join", initial=initial)
        joined = self._expect("joined")
        return int(joined["round"]), bool(joined["left"])

    def start(self, r: int, work: Work, local: LocalReader | None = None) -> None:
        """Round r, from the shared snapshot (`local`: never given; the sync process reads the snapshot)."""
        self._send("round", round=r, work=asdict(work))
        self._in_flight = True

    def arrived(self) -> bool:
        return self._in_flight and self.conn.poll(0)

    def outcome(self) -> Outcome:
        msg = self._expect("done")
        self._in_flight = False
        return Outcome(int(msg["round"]), str(msg["action"]), int(msg["part"]),
                       from_record(RoundMetrics, msg["row"], where="the sync process's row"),
                       exchange_s=float(msg["exchange_s"]), leave=bool(msg["leave"]),
                       ended=None if msg.get("ended") is None else float(msg["ended"]))

    def applied(self, r: int, **timings: float) -> None:
        self._send("applied", round=r, **timings)

    def check(self) -> None:
        """Between rounds nothing is expected from the sync process: anything readable is its end."""
        if not self._in_flight and self.conn.poll(0):
            self._expect("nothing")

    def settle(self) -> None:
        self._send("settle")
        self._expect("settled")

    def checkpoint_last(self) -> None:
        self._send("checkpoint_last")
        self._expect("checkpointed")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self._send("close")
                self._expect("closed")
            finally:
                self._reap()
        self.conn.close()

    # -- the answers -------------------------------------------------------------------------

    def _send(self, op: str, **fields: Any) -> None:
        try:
            send(self.conn, op, **fields)
        except OSError:  # it died between our requests: the same one line as a death seen on a read
            self._gone()

    def _expect(self, op: str) -> dict[str, Any]:
        try:
            msg = receive(self.conn)
        except (EOFError, OSError):
            self._gone()
        if msg["op"] == "error":
            self._reap()
            raise _RAISED.get(msg.get("kind"), RoundFailed)(str(msg.get("message")))
        if msg["op"] != op:
            raise RoundFailed(f"the sync process answered {msg['op']!r} where {op!r} was due")
        return msg

    def _gone(self) -> None:
        self._reap()
        raise RoundFailed(f"the sync process (pid {self.proc.pid}) {self._how_it_ended()}; this replica stops "
                          f"rather than train without it") from None

    def _reap(self) -> None:
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _how_it_ended(self) -> str:
        code = self.proc.returncode
        if code is None:
            return "stopped answering"
        if code < 0:
            return f"was killed by signal {code * -1}"
        return f"exited with code {code}"


def lane_numel(total: int, lanes: Lanes) -> int:
    """The values this lane syncs of a model of `total` (`layout.lane_range`)."""
    a, b = lane_range(total, lanes.count, lanes.index)
    return b - a
