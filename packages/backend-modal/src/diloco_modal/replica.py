"""Function mode, inside the container: the body of your own `@app.function`.

    @app.function(gpu="H100:8", image=image, timeout=24 * 3600, secrets=[modal.Secret.from_name("aws")])
    def replica(rank: int, **launch):
        return diloco_modal.run_replica(rank, **launch)

The executor spawns the function once per replica with `rank=i` as an explicit keyword (a Modal
container starts with a clean environment, so the rank cannot travel through it) and the rest
of the replica's environment in `diloco_env` (and the spec's forwarded secrets in `diloco_secrets`). This module sets them and runs the same replica
command every backend runs (`diloco.procgroup.replica_command`: the runner, or torchrun over
`processes_per_replica` runners), forwarding Modal's preemption notice (SIGINT) and SIGTERM.

Stdlib and diloco-core only: the container needs diloco-replica for training, not modal here.
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

from diloco import envvars
from diloco.failures import cause
from diloco.procgroup import replica_command
from diloco.runner import RESULT_PREFIX


class ReplicaFailed(RuntimeError):
    """The replica stopped with a non-zero exit; the message starts with its cause."""


def run_replica(rank: int, diloco_env: Mapping[str, str], processes_per_replica: int = 1,
                diloco_secrets: Mapping[str, str] | None = None) -> Any:
    """Run one replica in this container and return its entrypoint's (JSON) result.

    Raises `ReplicaFailed` with the replica's cause line (the same one `diloco status` shows) so
    the Modal call fails visibly; the cause is also the last line of the call's logs.
    """
    env = {**os.environ, **{str(k): str(v) for k, v in {**diloco_env, **(diloco_secrets or {})}.items()},
           envvars.ENV_RANK: str(int(rank))}
    with tempfile.TemporaryDirectory(prefix="diloco-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        env[envvars.ENV_RESULT_PATH] = result_path
        proc = subprocess.Popen(replica_command(processes_per_replica, python=sys.executable), env=env)
        forwarded = {sig: signal.signal(sig, lambda s, _f: proc.send_signal(s)) for sig in (signal.SIGINT, signal.SIGTERM)}
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
        if result.get("result") is not None:  # the launcher reads it from the call's logs (JSON, never pickle)
            print(f"{RESULT_PREFIX}{json.dumps({'result': result['result']}, default=repr)}", flush=True)
        return result.get("result")
    raise ReplicaFailed(f"{cause(result.get('error')) or 'replica failed'} (exit code {code})")
