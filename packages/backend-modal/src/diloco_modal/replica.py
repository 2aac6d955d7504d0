"""Function mode, inside the container: the body of your own `@app.function`.

    @app.function(gpu="H100:8", image=image, timeout=24 * 3600, secrets=[modal.Secret.from_name("aws")])
    def replica(rank: int, **launch):
        return diloco_modal.run_replica(rank, **launch)

The executor spawns the function once per replica with `rank=i` as an explicit keyword (a Modal
container starts with a clean environment, so the rank cannot travel through it) and the rest
of the replica's environment in `diloco_env`; this module sets them and runs the same replica
command every backend runs (`diloco.procgroup.replica_command`: the runner, or torchrun over
`processes_per_replica` runners), forwarding Modal's preemption notice (SIGINT) and SIGTERM. The
spec's forwarded secrets are not among the arguments: they are already in this container's
environment, from a Modal secret the executor attached to the call (`with_options`), so a
call's input never holds one.

A replica of `nodes = K` machines is one call of a clustered function: Modal runs this body in
each of the call's K containers with the same input, and each runs the replica's node command
with its node rank and container 0's address (`cluster.placement`, from Modal's cluster info).
Every container writes its own result; container 0 holds the replica's process 0, so its return
value is the replica's, and a clustered call returns rank 0's output. A cluster of another size
than `nodes` stops in one line before anything starts (exit 78).

Preemption: Modal's container runtime restarts an input (in a new container, on the same
input) only when the function raises KeyboardInterrupt, which is how its SIGINT surfaces; any
other exception becomes the input's failed result. So when the replica stopped because of the
SIGINT (exit 75, "preempted"), `run_replica` raises KeyboardInterrupt and Modal restarts the
input: the replica rejoins from the store, as a relaunched one does on any backend.

Stdlib and diloco-core, and modal only to read the cluster (`cluster`; inside a container Modal's
runtime has imported it already): the container needs diloco-replica for training.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from typing import Any

from diloco.inputs import envvars
from diloco.errors import EXIT_CONFIG, EXIT_PREEMPTED
from diloco.bootstrap.failures import USER_ERROR_PREFIX, cause
from diloco.procgroup import replica_command
from diloco.inputs.resultline import RESULT_PREFIX

from .cluster import ClusterMismatch, placement


class ReplicaFailed(RuntimeError):
    """The replica stopped with a non-zero exit; the message starts with its cause."""


def run_replica(rank: int, diloco_env: Mapping[str, str], processes_per_replica: int = 1, nodes: int = 1) -> Any:
    """Run one replica (or, with `nodes` > 1, this container's node of it) in this container and
    return its entrypoint's (JSON) result; `processes_per_replica` is per container.

    Raises `ReplicaFailed` with the replica's cause line (the same one `diloco status` shows) so
    the Modal call fails visibly; the cause is also the last line of the call's logs. A replica
    preempted by Modal's SIGINT raises KeyboardInterrupt instead, so Modal restarts the input.
    """
    try:
        node = placement(int(nodes))
    except ClusterMismatch as exc:  # before anything starts: a relaunch would meet the same function
        print(f"{USER_ERROR_PREFIX}{exc}", file=sys.stderr, flush=True)
        raise ReplicaFailed(f"{exc} (exit code {EXIT_CONFIG})") from None
    env = {**os.environ, **{str(k): str(v) for k, v in diloco_env.items()}, envvars.ENV_RANK: str(int(rank)),
           **node.env}
    with tempfile.TemporaryDirectory(prefix="diloco-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        env[envvars.ENV_RESULT_PATH] = result_path
        proc = subprocess.Popen(replica_command(processes_per_replica, int(nodes), python=sys.executable), env=env)
        notices: list[int] = []

        def forward(sig: int, _frame: Any) -> None:
            notices.append(sig)
            proc.send_signal(sig)

        forwarded = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            code = proc.wait()
        finally:
            for sig, old in forwarded.items():
                signal.signal(sig, old)
        try:
            with open(result_path) as f:
                result = json.load(f)
        except (OSError, ValueError):
            result = {}
    if code == 0:
        if node.node_rank == 0 and result.get("result") is not None:  # the launcher reads it from the call's logs
            # (JSON, never pickle); only container 0's: the others hold no process 0, and Modal returns rank 0's
            print(f"{RESULT_PREFIX}{json.dumps({'result': result['result']}, default=repr)}", flush=True)
        return result.get("result")
    why = f"{cause(result.get('error')) or 'replica failed'} (exit code {code})"
    if code == EXIT_PREEMPTED and signal.SIGINT in notices:
        print(f"{why}; Modal restarts this input", file=sys.stderr, flush=True)
        raise KeyboardInterrupt(why)  # Modal's runtime restarts an input on this, and on nothing else
    raise ReplicaFailed(why)
