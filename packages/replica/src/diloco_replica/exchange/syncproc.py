"""The sync process: a replica's (a lane's) rounds run here, beside the training process.

`python -m diloco_replica.exchange.syncproc FD PARENT_PID` is started by `syncclient.SyncProcess`, one per
training process. It maps the two shared buffers (`sharedbuf`), builds the `exchanger.Exchanger`
and then answers the training process's requests, one at a time, over the socket FD: JSON
messages framed by `multiprocessing.connection` (never pickle). Everything a round costs the
host — store requests, checksums, decoding, folding, the outer step, checkpoints, the round's
record — runs on this process's interpreter and threads, not the training loop's.

It lives exactly as long as its training process: the kernel kills it when the parent dies
(PR_SET_PDEATHSIG), so a SIGKILLed replica leaves no orphan; any error it meets is sent back as
one message (`error`: the exception's kind and its line) and it exits, so the replica fails with
that line rather than training on alone.

Several lanes (torchrun): the lanes' sync processes form a gloo group of their own, over a file
the training processes agreed on, for the lanes' agreements (`lanes.Lanes`).
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import asdict
from multiprocessing.connection import Connection

from .syncwire import receive, send


def _die_with_parent(parent: int) -> None:
    """Be killed when the training process dies, however it dies (Linux); elsewhere, checked per message."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # it died before the line above took effect
        os._exit(1)


def serve(conn: Connection, parent: int) -> int:
    import torch

    from diloco.bootstrap.context import ReplicaContext
    from diloco.inputs.envvars import ENV_FAULT_CLOCK_SKEW
    from diloco.spec.settings import DilocoSettings

    from . import sharedbuf
    from .exchanger import Exchanger, Work
    from ..round.lanes import Lanes
    from .syncclient import lane_numel

    start = receive(conn)
    if start["op"] != "start":
        raise ValueError(f"expected the start message, got {start['op']!r}")
    if start.get("threads"):
        torch.set_num_threads(int(start["threads"]))
    total = int(start["total"])
    c = start["ctx"]
    numel = lane_numel(total, Lanes(int(c["lane"]), int(c["lanes"])))
    theta = sharedbuf.attach(start["theta"], numel)
    snapshot = sharedbuf.attach(start["snapshot"], numel)
    send(conn, "mapped")
    settings = DilocoSettings.from_table(start["settings"], where="the sync process's settings")
    ctx = ReplicaContext(int(c["rank"]), int(c["world_size"]), str(c["run_id"]), int(c["attempt"]),
                         str(c["rendezvous"]), lane=int(c["lane"]), lanes=int(c["lanes"]), rerun=int(c["rerun"]),
                         settings=settings.to_dict())  # its store waits out outages as the spec says
    if os.environ.get(ENV_FAULT_CLOCK_SKEW):  # a test's skewed wall clock (diloco.bootstrap.clockskew)
        from diloco.bootstrap.clockskew import install_from_env

        install_from_env(ctx.rank)
    lanes = Lanes()
    if ctx.lanes > 1:
        import torch.distributed as dist

        host, _, port = str(start["lanes_at"]).rpartition(":")
        meeting = dist.PrefixStore("diloco-sync", dist.TCPStore(host, int(port), is_master=False))
        dist.init_process_group("gloo", store=meeting, rank=ctx.lane, world_size=ctx.lanes)
        lanes = Lanes.join(ctx.lanes, ctx.lane, ctx.log.info)
    exchanger = Exchanger(ctx, settings, ctx.store, total, lanes, log=ctx.log.info, theta_out=theta)
    while True:
        msg = receive(conn)
        op = msg["op"]
        if op == "join":
            initial = (lambda: snapshot) if msg.get("initial") else None  # the training loop waits: no copy
            r, left = exchanger.join(initial)
            send(conn, "joined", round=r, left=left)
        elif op == "round":
            out = exchanger.run(int(msg["round"]), snapshot, Work(**msg["work"]))
            send(conn, "done", round=out.round, action=out.action, part=out.part, row=asdict(out.row), leave=out.leave,
                 exchange_s=out.exchange_s, ended=out.ended)
        elif op == "applied":
            exchanger.applied(int(msg["round"]), sync_s=float(msg["sync_s"]), outer_s=float(msg["outer_s"]),
                              hidden_s=float(msg["hidden_s"]))
        elif op == "settle":
            exchanger.settle()
            send(conn, "settled")
        elif op == "checkpoint_last":
            exchanger.checkpoint_last()
            send(conn, "checkpointed")
        elif op == "close":
            exchanger.close()
            lanes.close()
            send(conn, "closed")
            return 0
        else:
            raise ValueError(f"unknown request {op!r}")
        if os.getppid() != parent:
            return 1


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    fd, parent = int(args[0]), int(args[1])
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the process group: the parent decides
    conn = Connection(fd)
    try:
        return serve(conn, parent)
    except (EOFError, ConnectionError):
        return 1  # the training process went away
    except BaseException as exc:  # every failure goes back as one line; the training process raises it
        kind = crossing_kind(exc)
        try:
            send(conn, "error", kind=kind or "RoundFailed",
                 message=str(exc) if kind else f"the sync process failed: {type(exc).__name__}: {exc}")
        except (OSError, ValueError):
            pass
        if kind is None:
            import traceback

            traceback.print_exc()  # a bug here: its trace goes to the replica's log, the line to its failure
        return 1


def crossing_kind(exc: BaseException) -> str | None:
    """The kind under which `exc` is raised again in the training process (None: a bug here)."""
    from diloco.errors import UserError

    from ..transport.finite import NonFinite
    from ..round.errors import FellBehind, RoundFailed

    for cls in (FellBehind, RoundFailed, NonFinite, UserError):
        if isinstance(exc, cls):
            return cls.__name__
    return None


if __name__ == "__main__":
    sys.exit(main())
