"""`python -m diloco_replica.torchrun <torchrun arguments>`: torch's launcher, with the exit code kept.

A multi-process replica is started by torch's own elastic launcher (`torch.distributed.run`,
torchrun): it owns the in-replica rendezvous, signal forwarding (SIGTERM reaches every
process) and group teardown (one process dies → the others are stopped). This module parses
torchrun's own arguments with torchrun's own parser and calls its `run`, unchanged; the command
every backend uses is built by `diloco.procgroup.replica_command`.

A replica of K nodes runs this on every node (`--nnodes K`, torch's static rendezvous: node r
holds the replica's processes r·P … r·P + P − 1), each given its node rank and the first node's
address by its platform (`diloco.procgroup.node_env`); each node writes its own result, and the
platform ends the other nodes when one ends (the replica is relaunched as one attempt).

What it adds is what the supervisor needs from one replica and torchrun does not give:
- the exit code of the process that failed first (torchrun exits 1 for any failure): 78 for a
  spec or store mistake, so the run stops instead of relaunching; 128+N for signal N;
- one result for the node (`DILOCO_RESULT_PATH`), built from its processes' results: process
  0's on success (a node without process 0: a plain success), else the first failure's (its
  cause line first, as with one process).
"""

from __future__ import annotations

import json
import os
import signal
import sys

from diloco.inputs import envvars
from diloco.errors import EXIT_CONFIG, EXIT_PREEMPTED
from diloco.bootstrap.failures import CAUSE_PREFIX, PREEMPTED_CAUSE, USER_ERROR_PREFIX
from diloco.bootstrap.runner import lane_result_path, preemption_signal, write_text_atomic


def _read(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def node_lanes(node_rank: int, per_node: int) -> range:
    """The processes (lanes) of a replica that node `node_rank` runs: torch's static rendezvous
    gives node r the global ranks r·P … r·P + P − 1."""
    return range(node_rank * per_node, (node_rank + 1) * per_node)


def finish(result_path: str | None, lanes: range, total: int, failed_lane: int | None, code: int, *,
           rank: int, attempt: int) -> int:
    """Write this node's result from its processes' results (`lanes`, of the replica's `total`);
    return its exit code."""
    parts = {k: _read(lane_result_path(result_path, k)) for k in lanes} if result_path else {}
    where = f"process {failed_lane} of {total}"
    if total > len(lanes) and failed_lane is not None:
        where += f" (node {failed_lane // len(lanes)})"
    if failed_lane is None:
        result = parts.get(0) or {"rank": rank, "attempt": attempt, "status": "succeeded", "exit_code": 0}
        exit_code = 0
    else:
        mine = parts.get(failed_lane)
        if mine and mine.get("status") == "failed":
            result, exit_code = dict(mine), int(mine.get("exit_code") or _exit_code(code))
            result["error"] = f"{mine.get('error') or ''}\n({where})".lstrip()
        else:
            how = f"killed by {_signal_name(code)}" if code < 0 else f"exited with code {code}"
            exit_code = _exit_code(code)
            result = {"rank": rank, "attempt": attempt, "status": "failed", "exit_code": exit_code,
                      "error": f"{where} {how}; torchrun stopped the replica's other processes"}
    if result_path:
        write_text_atomic(result_path, json.dumps(result))
    return exit_code


def signals_to_handle(handled: str, preemption: signal.Signals | None) -> str:
    """torchrun's `--signals-to-handle` with the platform's preemption signal added: torchrun
    stops its processes on the signals it handles and dies of any other (Slurm's SIGUSR1 would
    end the agent with no result, a failure instead of a preemption)."""
    names = [n.strip() for n in handled.split(",") if n.strip()]
    if preemption is not None and preemption.name not in names:
        names.append(preemption.name)
    return ",".join(names)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.max_restarts:
        print("diloco_replica.torchrun: --max-restarts must be 0 (diloco's supervisor owns restarts)", file=sys.stderr)
        return 2
    args.signals_to_handle = signals_to_handle(args.signals_to_handle, preemption_signal())
    per_node, nodes = int(str(args.nproc_per_node)), int(str(args.nnodes))
    if nodes > 1 and not os.environ.get("PET_MASTER_ADDR"):
        print(f"{USER_ERROR_PREFIX}a replica of {nodes} nodes needs each node's rank and the first node's address "
              f"(PET_NODE_RANK, PET_MASTER_ADDR: diloco.procgroup.node_env); this node's platform set none",
              file=sys.stderr, flush=True)
        return EXIT_CONFIG
    lanes, total = node_lanes(int(args.node_rank) if nodes > 1 else 0, per_node), per_node * nodes
    result_path = os.environ.get(envvars.ENV_RESULT_PATH)
    rank, attempt = int(os.environ.get(envvars.ENV_RANK, "0")), int(os.environ.get(envvars.ENV_ATTEMPT, "0"))
    for k in lanes:  # results of an earlier attempt with the same stem must not be read as this one's
        if result_path and os.path.exists(lane_result_path(result_path, k)):
            os.unlink(lane_result_path(result_path, k))
    try:
        run(args)
    except ChildFailedError as exc:
        global_rank, failure = exc.get_first_failure()
        return finish(result_path, lanes, total, global_rank, failure.exitcode, rank=rank, attempt=attempt)
    except SignalException as exc:  # torchrun has stopped the processes
        if exc.sigval == preemption_signal():  # the platform's preemption notice, not a cancel
            cause = PREEMPTED_CAUSE.format(signal=exc.sigval.name)
            print(f"{CAUSE_PREFIX}{cause}", file=sys.stderr, flush=True)
            if result_path:
                write_text_atomic(result_path, json.dumps({"rank": rank, "attempt": attempt, "status": "failed",
                                                           "exit_code": EXIT_PREEMPTED, "error": cause}))
            return EXIT_PREEMPTED
        return 128 + int(exc.sigval)  # SIGTERM/SIGINT: cancelled
    return finish(result_path, lanes, total, None, 0, rank=rank, attempt=attempt)


if __name__ == "__main__":
    sys.exit(main())
