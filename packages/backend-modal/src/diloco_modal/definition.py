"""What a spec-built replica is on Modal, as plain data first and modal objects second.

`image_definition` and `sandbox_request` turn the [backend] options (`ModalOptions`) and the
launch request into JSON-able dicts, which is what `diloco dryrun` prints and what the tests
check (the image's wheels and steps, the workdir's shipment); `build_image` / `build_mounts`
turn those dicts into modal objects only when launching, refusing a workdir that changed since.
Nothing here talks to Modal's servers.
"""

from __future__ import annotations

import hashlib
import shlex
import sys
from pathlib import Path
from typing import Any

from diloco.errors import UserError
from diloco.inputs.replicaenv import REDACTED
from diloco.shipping.workdir import select_files

from . import wheels
from .options import ModalOptions

CODE_DIR = "/root/diloco-workdir"  # where the spec's workdir lands inside every container
MAX_TIMEOUT = 24 * 3600  # Modal's longest sandbox lifetime
MAX_GPUS = 8
# Modal's GPU names (https://modal.com/docs/guide/gpu); `[backend] gpu_types` adds newer ones.
GPU_TYPES = ("T4", "L4", "A10", "A10G", "L40S", "A100", "A100-40GB", "A100-80GB", "H100", "H100!", "H200",
             "B200", "B200+")
CANCEL_TAG = "diloco-cancelled"
MAX_NAME = 64  # Modal's longest object name
NAME_HASH = 16  # hex characters of a run id's hash in a name cut to fit (64 bits)


def modal_gpu(gpu: str | None, extra_types: list[str] | tuple[str, ...] = ()) -> str | None:
    """The spec's logical GPU ("H100:8", "a10g") as Modal spells it, or a one-line error."""
    if not gpu:
        return None
    name, _, count = gpu.partition(":")
    known = {t.upper(): t for t in (*GPU_TYPES, *extra_types)}
    kind = known.get(name.strip().upper())
    if kind is None:
        raise UserError(f"unknown GPU type {name!r} for Modal; use one of {', '.join(GPU_TYPES)} "
                        f"(or add it to [backend] gpu_types if Modal has added it since)")
    if count:
        if not count.strip().isdigit() or not 1 <= int(count) <= MAX_GPUS:
            raise UserError(f"GPU count in {gpu!r} must be a whole number from 1 to {MAX_GPUS} (Modal's largest "
                            f"container has {MAX_GPUS} GPUs)")
        return f"{kind}:{int(count)}"
    return kind


def modal_timeout(timeout: float) -> int:
    if timeout > MAX_TIMEOUT:
        raise UserError(f"timeout {timeout:g}s exceeds Modal's longest sandbox lifetime ({MAX_TIMEOUT}s = 24 h); "
                        f"lower `timeout`: a replica that ends is relaunched and rejoins from the store")
    return max(int(timeout), 1)


def image_definition(opts: ModalOptions, workdir: str | None) -> dict[str, Any]:
    """The container image, as data: a registry image (which must hold diloco-replica), or
    debian_slim with the launcher's own diloco as wheels (`wheels`, never from an index); then
    the user's packages; then the workdir's shipped files at CODE_DIR (`shipment`: what
    `diloco.shipping.workdir.select_files` chose, summarized). `steps` are the build steps, in order."""
    out: dict[str, Any] = {}
    steps: list[dict[str, str]] = []
    if opts.image:
        out["base"] = {"registry": opts.image}
    else:
        version = opts.python_version or f"{sys.version_info.major}.{sys.version_info.minor}"
        out["base"] = {"debian_slim": {"python_version": version}}
        out["wheels"] = wheels.planned()
        steps += [{"copy": w["file"], "to": w["path"]} for w in out["wheels"]]
        steps.append({"run": wheels.install_command(out["wheels"])})
    out["pip"] = list(opts.pip)
    if opts.pip:
        steps.append({"run": shlex.join(["python", "-m", "pip", "install", *opts.pip])})
    if opts.requirements:
        path = (Path(workdir or ".") / opts.requirements).resolve()
        if not path.is_file():
            raise UserError(f"[backend] requirements {opts.requirements!r}: no such file {str(path)!r}")
        out["requirements"] = str(path)
        steps.append({"requirements": str(path)})
    out["steps"] = steps
    if opts.include_workdir and workdir:
        shipment = select_files(workdir, opts.ignore)
        out["workdir"] = {"local": str(shipment.root), "remote": CODE_DIR, "ignore": list(opts.ignore),
                          "shipment": shipment.summary()}
    return out


def sandbox_request(*, opts: ModalOptions, command: list[str], name: str, tags: dict[str, str],
                    gpu: str | None, timeout: float, env: dict[str, str], secret_names: list[str],
                    workdir_shipped: bool) -> dict[str, Any]:
    """The keyword arguments of one `modal.Sandbox.create` call, as data (secret values left out:
    `secret_names` lists the forwarded ones, which travel as one `Secret.from_dict`)."""
    req: dict[str, Any] = {
        "command": command, "name": name, "tags": tags, "gpu": modal_gpu(gpu, opts.gpu_types),
        "timeout": modal_timeout(timeout), "env": env,
        "secrets": {"forwarded": {k: REDACTED for k in secret_names}, "named": list(opts.secrets)},
        "volumes": dict(opts.volumes), "bucket_mounts": {k: dict(v) for k, v in opts.bucket_mounts.items()},
    }
    if workdir_shipped:
        req["workdir"] = CODE_DIR
    for key in ("cpu", "memory", "region", "cloud"):
        if getattr(opts, key) is not None:
            req[key] = getattr(opts, key)
    return req


def sandbox_name(run_id: str, rank: int, attempt: int) -> str:
    """Unique within the app, one per run, rank and attempt; Modal allows 64 characters. A run id
    that does not fit is cut, and the cut part replaced by a hash of the whole run id: its random
    tail is at its end, so cutting alone gave two runs the same names."""
    suffix = f"-r{rank}-a{attempt}"
    if len(run_id) + len(suffix) <= MAX_NAME:
        return run_id + suffix
    digest = hashlib.sha256(run_id.encode()).hexdigest()[:NAME_HASH]
    return run_id[: MAX_NAME - len(suffix) - NAME_HASH - 1].rstrip("-.") + f"-{digest}{suffix}"


# -- modal objects (only when launching) -------------------------------------------------------


def build_image(modal: Any, definition: dict[str, Any], wheel_files: dict[str, Path]) -> Any:
    """The modal Image of a definition, step by step as planned; `wheel_files` are the planned
    wheels built here ({file name: local path}, `wheels.materialize`)."""
    base = definition["base"]
    if "registry" in base:
        image = modal.Image.from_registry(base["registry"])
    else:
        image = modal.Image.debian_slim(python_version=base["debian_slim"]["python_version"])
    for step in definition["steps"]:
        if "copy" in step:
            image = image.add_local_file(wheel_files[step["copy"]], step["to"], copy=True)
        elif "run" in step:
            image = image.run_commands(step["run"])
        else:
            image = image.pip_install_from_requirements(step["requirements"])
    shipped = definition.get("workdir")
    if shipped:  # last: Modal adds local files at container start, after every build step
        shipment = select_files(shipped["local"], shipped["ignore"])
        if shipment.summary() != shipped["shipment"]:
            raise UserError(f"the workdir {shipped['local']!r} changed since it was planned: plan and launch again, "
                            f"so what is uploaded is what the dry run listed")
        image = image.add_local_dir(shipment.root, shipped["remote"],
                                    ignore=lambda rel: not shipment.includes(Path(rel).as_posix()))
    return image


def build_mounts(modal: Any, request: dict[str, Any], environment: str | None) -> dict[str, Any]:
    mounts: dict[str, Any] = {}
    for path, volume in request["volumes"].items():
        mounts[path] = modal.Volume.from_name(volume, environment_name=environment)
    for path, spec in request["bucket_mounts"].items():
        spec = dict(spec)
        secret = spec.pop("secret", None)
        bucket = spec.pop("bucket", None)
        if not bucket:
            raise UserError(f"[backend] bucket_mounts.{path!r} needs `bucket`")
        if secret:
            spec["secret"] = modal.Secret.from_name(secret, environment_name=environment)
        try:
            mounts[path] = modal.CloudBucketMount(bucket, **spec)
        except TypeError as exc:
            raise UserError(f"[backend] bucket_mounts.{path!r}: {exc}") from None
    return mounts
