"""The plan body of each mode, built from the launch request and the `[backend]` options.

Plain data, what `diloco dryrun` prints and exactly what `ModalExecutor.submit` hands to Modal;
secret values appear nowhere in it (REDACTED under their names): `submit` adds them at the last
moment, as one `modal.Secret.from_dict` per sandbox, or one attached to the function's calls with
`with_options` (never a spawn's input).

- sandbox mode: `{"mode": "sandbox", "app", "environment", "image", "sandboxes": [one
  `Sandbox.create` call per rank]}`;
- function mode: `{"mode": "function", "function", "deploy", "environment", "secrets":
  {"forwarded": {name: REDACTED}}, "spawn": [one `fn.spawn` call per rank]}`, and with `nodes`
  K > 1 `"cluster_size": K`: each call runs on K containers of a function decorated with
  `@modal.clustered(size=K)`, and each spawn carries `nodes = K` (`cluster`).

Replicas of several machines exist on Modal only as clustered function calls: Modal places the
containers of one call together (gang-scheduled, on its fast network), and nothing places
sandboxes together, so sandbox mode refuses `nodes` > 1 in one line.
"""

from __future__ import annotations

from typing import Any

from diloco.inputs.envvars import ENV_PREEMPTION_SIGNAL
from diloco.errors import UserError
from diloco.procgroup import replica_command
from diloco.request import LaunchRequest

from . import definition as d
from .options import ModalOptions

PREEMPTION_SIGNAL = "SIGINT"  # Modal's preemption notice to a container (modal.com/docs/guide/preemption)
RUN_TAG, RANK_TAG, ATTEMPT_TAG = "diloco-run", "diloco-rank", "diloco-attempt"


def replica_env(request: LaunchRequest, rank: int, *, ships_workdir: bool) -> dict[str, str]:
    """One rank's environment in a container (no secrets): the launcher's PYTHONPATH means nothing
    there; the shipped workdir is on it instead."""
    out = request.replica_env(rank)
    out.pop("PYTHONPATH", None)
    out[ENV_PREEMPTION_SIGNAL] = PREEMPTION_SIGNAL
    if ships_workdir:
        out["PYTHONPATH"] = d.CODE_DIR
    return out


def sandbox_plan(opts: ModalOptions, request: LaunchRequest) -> dict[str, Any]:
    """Sandbox mode: the image and one `modal.Sandbox.create` call per rank, as data."""
    if request.nodes > 1:
        raise UserError(f"nodes = {request.nodes}: Modal places several containers together only as one call of a "
                        f"clustered function, never sandboxes; use function mode ([backend] function = ..., a function "
                        f"decorated with @modal.clustered(size={request.nodes})) or nodes = 1")
    image = d.image_definition(opts, request.workdir)
    shipped = "workdir" in image
    command = replica_command(request.processes_per_replica)
    sandboxes = []
    for rank in request.ranks:
        tags = {RUN_TAG: request.run_id, RANK_TAG: str(rank), ATTEMPT_TAG: str(request.attempt)}
        sandboxes.append(d.sandbox_request(
            opts=opts, command=command, name=d.sandbox_name(request.run_id, rank, request.attempt), tags=tags,
            gpu=request.gpu, timeout=request.timeout, env=replica_env(request, rank, ships_workdir=shipped),
            secret_names=request.secrets.names, workdir_shipped=shipped))
    return {"mode": "sandbox", "app": opts.app_name, "environment": opts.environment, "image": image,
            "sandboxes": sandboxes}


def function_plan(opts: ModalOptions, request: LaunchRequest) -> dict[str, Any]:
    """Function mode: one `fn.spawn(rank=..., diloco_env=..., ...)` call per rank, as data."""
    if request.gpu:
        raise UserError(f"function mode: the GPU is set by your @app.function(gpu=...), not the spec; remove "
                        f"`gpu = {request.gpu!r}` (and set processes_per_replica to the function's GPU count)")
    cluster = {"nodes": request.nodes} if request.nodes > 1 else {}  # a one-node call's input is as before
    spawns = [{"rank": rank, "diloco_env": replica_env(request, rank, ships_workdir=False),
               "processes_per_replica": request.processes_per_replica, **cluster} for rank in request.ranks]
    body = {"mode": "function", "function": opts.function, "deploy": opts.deploy, "environment": opts.environment}
    if request.nodes > 1:
        body["cluster_size"] = request.nodes
    return {**body, "secrets": {"forwarded": request.secrets.redacted()}, "spawn": spawns}
