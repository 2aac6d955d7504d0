"""Image definitions in the fake Modal cloud: recorded and checked, never built.

Modal builds an image from the definition the client sends (`api_pb2.Image`: a base image,
Dockerfile commands, context files and a context mount for `COPY`). The fake keeps that
definition and decides, without a registry or Docker, what a build would do with the steps
diloco's images use:

- `COPY . /` of a context mount: its files land in the image (tracked, layer by layer);
- `pip install` (also `python -m pip`, `uv pip`, `-r` of a context file): a local path must be
  a file an earlier `COPY` put in the image (a wheel shipped from the launcher); a name is
  fetched from the package index, which holds everything except distributions that are not
  published there (`UNPUBLISHED`: diloco's own), so installing those fails as pip fails;
  `--no-index` (a container without internet) makes every name fail;
- other steps (`apt-get`, `FROM python:…`) succeed.

A failed build is answered as Modal answers it: `ImageJoinStreaming` ends with a failure
result, and the client raises `ImageBuildError` with pip's words.
"""

from __future__ import annotations

import fnmatch
import re
import shlex
from typing import Any

from modal_proto import api_pb2

UNPUBLISHED = {"diloco-core", "diloco-replica", "diloco-backend-modal", "diloco-backend-eks",
               "diloco-backend-sagemaker"}
_VALUE_OPTIONS = {"-r", "--requirement", "-c", "--constraint", "-i", "--index-url", "--extra-index-url", "-f",
                  "--find-links", "-t", "--target", "--prefix", "--root", "-e", "--editable", "--python"}
_FROM_PYTHON = re.compile(r"^FROM python:(\d+\.\d+)")


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pip_args(command: str) -> list[str] | None:
    """The arguments after `pip install` in a RUN step, or None if it installs nothing."""
    try:
        words = shlex.split(command)
    except ValueError:
        return None
    for i in range(len(words) - 1):
        if words[i] == "pip" and words[i + 1] == "install":
            rest = words[i + 2:]
            for stop in ("&&", ";", "||"):
                if stop in rest:
                    rest = rest[: rest.index(stop)]
            return rest
    return None


def _install(args: list[str], files: dict[str, str], context: dict[str, str]) -> list[str]:
    """What pip would fail with for one `pip install ARGS` ([] if it succeeds)."""
    errors: list[str] = []
    requirements: list[str] = []
    no_index = "--no-index" in args
    skip = False
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if arg in ("-r", "--requirement") and i + 1 < len(args):
            text = context.get(args[i + 1])
            if text is None and args[i + 1] not in files:
                errors.append(f"ERROR: Could not open requirements file: No such file: '{args[i + 1]}'")
            requirements += [ln.split("#")[0].strip() for ln in (text or "").splitlines() if ln.split("#")[0].strip()]
            skip = True
        elif arg in _VALUE_OPTIONS:
            skip = True
        elif not arg.startswith("-"):
            requirements.append(arg)
    for req in requirements:
        if req.startswith(("/", "./")) or req.endswith((".whl", ".tar.gz", ".zip")):
            if not any(fnmatch.fnmatch(path, req) for path in files):
                errors.append(f"ERROR: Invalid requirement: '{req}': the file does not exist in the image")
            continue
        name = _normalize(re.match(r"[A-Za-z0-9._-]*", req).group(0) or req)
        if no_index or name in UNPUBLISHED:
            errors.append(f"ERROR: Could not find a version that satisfies the requirement {req} (from versions: "
                          f"none)\nERROR: No matching distribution found for {req}")
    return errors


def record(store: Any, image: api_pb2.Image) -> dict[str, Any]:
    """The stored record of an image definition, with the outcome its build would have."""
    files: dict[str, str] = {}  # path in the image -> sha256 of its content
    python = ""
    bases = []
    for base in image.base_images:
        parent = store.get(base.image_id) or {}
        bases.append(base.image_id)
        files.update(parent.get("files", {}))
        python = python or parent.get("python", "")
    context = {f.filename: f.data.decode(errors="replace") for f in image.context_files}
    mount = store.get(image.context_mount_id) if image.context_mount_id else None
    log: list[str] = []
    errors: list[str] = []
    for command in image.dockerfile_commands:
        log.append(command)
        found = _FROM_PYTHON.match(command)
        if found:
            python = found.group(1)
        if command.startswith("COPY ") and mount is not None and command.split()[1] == ".":
            dest = command.split()[2].rstrip("/")
            for f in mount["files"]:
                files[f"{dest}/{f['filename'].lstrip('/')}"] = f["sha256_hex"]
        if command.startswith("RUN "):
            args = _pip_args(command[4:])
            if args is not None:
                errors += _install(args, files, context)
        if errors:
            break
    return {"kind": "image", "base_images": bases, "dockerfile_commands": list(image.dockerfile_commands),
            "context_files": sorted(context), "context_mount_id": image.context_mount_id, "files": files,
            "python": python, "status": "failure" if errors else "success", "error": "\n".join(errors),
            "build_log": log + errors}
