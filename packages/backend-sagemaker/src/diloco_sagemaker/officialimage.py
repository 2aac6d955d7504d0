"""The training image: `[backend] image` as given, or the official PyTorch training image with
the launcher's own diloco shipped beside the code.

diloco is not on a package index, a replica must run the diloco that planned its run, and a job
in a VPC without NAT has no internet. So for `pytorch_version` the image's URI comes from
sagemaker-core's image list (the optional `images` extra), and diloco-core, diloco-replica and
what they need beyond the image's own torch and numpy are shipped as wheels built from the
launcher's installation (`diloco.shipping.wheelhouse`), which the bootstrap installs with
`pip install --no-index --find-links` at every start.

The image's Python is known from `py_version` or from the image tag (`…-py312-…`): a wheel
that does not install there (diloco needs Python ≥ 3.11; a native wheel built for another
platform) is refused at plan time, in one line.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

from diloco.errors import UserError

from .options import SageMakerOptions

IMAGE_HOLDS = ("torch", "numpy")  # what diloco-replica needs that the official PyTorch images hold
PLATFORM = "manylinux_2_31_x86_64"  # the official images: Ubuntu 20.04 (glibc 2.31) and later


def resolve_image(opts: SageMakerOptions, region: str, instance: str) -> str:
    """The training image: `image` as given, or the official PyTorch training image for
    `pytorch_version` through sagemaker-core's image_uris (the optional `images` extra)."""
    if opts.image:
        return opts.image
    if not opts.pytorch_version:
        raise UserError("[backend] image is needed: an ECR image with diloco-replica installed (see "
                        "packages/replica/README.md), or pytorch_version = \"2.8\" for the official PyTorch "
                        "training image (pip install 'diloco-backend-sagemaker[images]')")
    try:
        from sagemaker.core import image_uris
    except ImportError:
        raise UserError("[backend] pytorch_version needs sagemaker-core's image list: pip install "
                        "'diloco-backend-sagemaker[images]', or give an ECR `image`") from None
    try:
        return image_uris.retrieve("pytorch", region, version=opts.pytorch_version, py_version=opts.py_version,
                                   instance_type=instance, image_scope="training")
    except ValueError as exc:
        raise UserError(f"[backend] pytorch_version {opts.pytorch_version!r}: {exc}") from None


def image_python(opts: SageMakerOptions, image: str) -> str | None:
    """The official image's Python as "3.12", from py_version or the image tag; None if unknown."""
    found = re.fullmatch(r"py(\d)(\d+)", opts.py_version or "") or re.search(r"[-:]py(\d)(\d+)(?:-|$)", image)
    return f"{found[1]}.{found[2]}" if found else None


def _build(dest: Path, python: str | None) -> list[Path]:
    """The launcher's diloco and what it needs as wheels; a native one built for this machine's
    Python is swapped for the index's build of the same version for the image's Python."""
    from packaging.utils import parse_wheel_filename

    from diloco.shipping.wheelhouse import dependency_wheels, fetch_wheel, launcher_wheels, wheel_fits

    out = []
    for path in [*launcher_wheels(dest), *dependency_wheels(dest, exclude=IMAGE_HOLDS)]:
        if not wheel_fits(path, python=python or "3.11", platform=PLATFORM):
            name, version, _, _ = parse_wheel_filename(path.name)
            fetched = fetch_wheel(str(name), str(version), dest, python=python or "3.11", platform=PLATFORM)
            if fetched is not None:
                path.unlink()
                path = fetched
        out.append(path)
    return out


def check_python(python: str | None, opts: SageMakerOptions) -> None:
    """One line if the image's Python cannot hold diloco (its Requires-Python, as installed here)."""
    from importlib import metadata

    from packaging.specifiers import SpecifierSet

    if python is None:
        return
    for dist in ("diloco-core", "diloco-replica"):
        try:
            needs = metadata.metadata(dist).get("Requires-Python") or ""
        except metadata.PackageNotFoundError:
            continue  # building its wheel says so
        if needs and not SpecifierSet(needs).contains(python, prereleases=True):
            raise UserError(f"[backend] pytorch_version {opts.pytorch_version} with Python {python} cannot install "
                            f"{dist}, which needs Python {needs}: choose py_version = \"py311\" or later (and a "
                            f"pytorch_version that has it), or give an `image` holding diloco")


def check_fits(wheels: list[Path], python: str | None) -> None:
    """One line for the first wheel the image cannot install (a native wheel of another platform)."""
    from diloco.shipping.wheelhouse import wheel_fits

    for path in wheels:
        if not wheel_fits(path, python=python or "3.11", platform=PLATFORM):
            name = path.name.split("-")[0].replace("_", "-")
            raise UserError(f"{path.name} ({name}, built from this machine's installation) does not install on the "
                            f"official image (Python {python or '3.11'}, {PLATFORM}), and pip could not download "
                            f"a build of it for that Python: launch from Linux x86-64 with CPython "
                            f"{python or '3.11'}, or give an `image` holding diloco")


def planned_wheels(opts: SageMakerOptions, image: str) -> dict[str, Any] | None:
    """What is shipped for an official image: the wheels (names and sizes) and the requirements
    the bootstrap installs from them; None for an `image` of your own. Refuses what cannot install."""
    if not opts.pytorch_version:
        return None
    python = image_python(opts, image)
    check_python(python, opts)
    with tempfile.TemporaryDirectory(prefix="diloco-wheels-") as tmp:
        wheels = _build(Path(tmp), python)
        check_fits(wheels, python)
        listing = [{"file": p.name, "bytes": p.stat().st_size} for p in wheels]
    from diloco.inputs.replicaenv import pinned_requirement

    return {"python": python, "files": listing,
            "install": [pinned_requirement("diloco-core"), pinned_requirement("diloco-replica")]}


def build_wheels(dest: Path, python: str | None) -> list[Path]:
    """The wheels `planned_wheels` listed, built into `dest` for upload (reproducible: same bytes)."""
    return _build(dest, python)
