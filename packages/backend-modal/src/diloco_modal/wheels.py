"""The launcher's own diloco, as wheels for the default image (never from a package index).

A replica must run the diloco that planned its run, byte for byte: an index may not hold the
launcher's version (an editable install, a local change, a release not yet published), and one
that does could serve a different build. So the default image copies wheels built here, from the distributions
installed where `diloco run` runs (`diloco.shipping.wheelhouse.launcher_wheels`), into the image
(`Image.add_local_file(..., copy=True)`) and pip-installs them from those paths.

The plan names each wheel with its sha256 (wheels are reproducible: the same installation gives
the same bytes), and `materialize` builds them again at submit and refuses, in one line, wheels
that differ from the plan: what the dry run showed is what is shipped.

`replica_image()` is the same image for function mode, where you build the image of your own
`@app.function` (`image=diloco_modal.replica_image().add_local_python_source("train")`).
"""

from __future__ import annotations

import hashlib
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

from diloco.errors import UserError

WHEEL_DIR = "/opt/diloco/wheels"  # where the wheels land in the image


def _build(dest: Path) -> list[Path]:
    from diloco.shipping.wheelhouse import launcher_wheels  # loaded when planning the default image only

    return launcher_wheels(dest)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def planned() -> list[dict[str, str]]:
    """The wheels of the launcher's diloco, as the plan shows them: file name, sha256, path in the image."""
    with tempfile.TemporaryDirectory(prefix="diloco-wheels-") as tmp:
        return [{"file": w.name, "sha256": _sha256(w), "path": f"{WHEEL_DIR}/{w.name}"} for w in _build(Path(tmp))]


def install_command(wheels: list[dict[str, str]]) -> str:
    """The image step that installs them (their dependencies come from the index, as any pip step's)."""
    return shlex.join(["python", "-m", "pip", "install", *(w["path"] for w in wheels)])


def materialize(wheels: list[dict[str, str]], dest: Path) -> dict[str, Path]:
    """Build the planned wheels into `dest` and check they are the planned bytes: {file name: local path}."""
    built = {w.name: w for w in _build(dest)}
    for wheel in wheels:
        path = built.get(wheel["file"])
        if path is None or _sha256(path) != wheel["sha256"]:
            raise UserError(f"the diloco installed here changed since the plan ({wheel['file']} differs): plan and "
                            f"launch again, so the replicas run what the dry run showed")
    return {name: built[name] for name in (w["file"] for w in wheels)}



def replica_image(python_version: str | None = None) -> Any:
    """debian_slim with the launcher's own diloco installed from wheels: the base of a function
    mode image (`diloco-replica` is not on a package index). Inside a Modal container, where the
    image is already built, this returns the bare base and builds nothing."""
    import modal

    version = python_version or f"{sys.version_info.major}.{sys.version_info.minor}"
    image = modal.Image.debian_slim(python_version=version)
    if not modal.is_local():
        return image
    dest = Path(tempfile.mkdtemp(prefix="diloco-wheels-"))  # kept: modal uploads the files when it builds
    built = _build(dest)
    for wheel in built:
        image = image.add_local_file(wheel, f"{WHEEL_DIR}/{wheel.name}", copy=True)
    return image.run_commands(install_command([{"path": f"{WHEEL_DIR}/{w.name}"} for w in built]))
