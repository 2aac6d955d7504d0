"""Training images for the test control plane: an interpreter holding only what the image declares.

Images are not pulled here, but a container must not see the launcher's packages: on SageMaker
a replica finds boto3 only if its image holds it, and diloco only if the image (or the
bootstrap) installed it. So an image is a declaration — the distributions it holds, e.g. the
reference image (packages/replica/Dockerfile) holds torch, numpy, diloco-core and diloco-replica;
the official PyTorch training image holds torch and numpy — and the stand-in builds it as:

- an *image layer*: one directory per image (under the control plane's root), holding symbolic
  links to the installed files of each declared distribution and of everything it requires,
  taken from the Python that runs the tests (its `.pth` files too, so an editable checkout
  resolves). Built once, shared by every container of that image;
- a *container*: for each start of a job, a fresh virtual environment (a `pyvenv.cfg` and a
  `python` link to the base interpreter: no site-packages of the launcher) whose site-packages
  adds the image layer as a site directory. What the bootstrap `pip install`s lands in the
  container's own site-packages and is gone at the next start, as on a new instance. pip never
  uninstalls from the layer (it lies outside the environment, and pip leaves such files alone).

What it cannot be: the Python version is the tests' for every image (an image "with py310" runs
3.11 here), and native libraries are the machine's.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

# Distributions every image holds (a Python with pip: SageMaker images and the reference image do).
BASE = ("pip",)
REFERENCE_IMAGE = ("torch", "numpy", "diloco-core", "diloco-replica")
OFFICIAL_PYTORCH_IMAGE = ("torch", "numpy")
# image URI pattern → what it holds; the first pattern that matches wins
DEFAULT_IMAGES = {"*.dkr.ecr.*.amazonaws.com/pytorch-training:*": OFFICIAL_PYTORCH_IMAGE, "*": REFERENCE_IMAGE}


def declared(image: str, images: dict[str, list[str]] | None = None) -> list[str]:
    """The distributions `image` holds, from the control plane's image table."""
    for pattern, dists in {**(images or {}), **DEFAULT_IMAGES}.items():
        if fnmatch.fnmatchcase(image, pattern):
            return [*BASE, *dists]
    return list(BASE)


def _name(text: str) -> str:
    return text.lower().replace("_", "-").replace(".", "-")


def closure(names: list[str]) -> list[metadata.Distribution]:
    """The installed distributions `names` need, transitively (extras' requirements left out)."""
    from packaging.requirements import Requirement

    seen: dict[str, metadata.Distribution] = {}
    queue = list(names)
    while queue:
        name = queue.pop()
        if _name(name) in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # a requirement for another platform, or absent here: the image lacks it too
        seen[_name(name)] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                queue.append(req.name)
    return list(seen.values())


def _top_levels(dist: metadata.Distribution) -> set[Path]:
    """The site-packages entries a distribution installed (packages, modules, .pth, dist-info)."""
    site = Path(dist.locate_file(""))
    out = set()
    for f in dist.files or []:
        parts = Path(f).parts
        if parts and parts[0] != "..":
            out.add(site / parts[0])
    info = getattr(dist, "_path", None)
    if info is not None:
        out.add(Path(info))
    return {p for p in out if p.exists() and "__pycache__" not in p.name}


def image_layer(root: Path, image: str, images: dict[str, list[str]] | None = None) -> Path:
    """The image's layer directory under `root`, built on first use (atomically: many instance
    processes may ask at once)."""
    names = declared(image, images)
    key = "-".join(sorted(_name(n) for n in names))
    layer = Path(root) / "images" / key
    if layer.exists():
        return layer
    tmp = layer.with_name(f".{key}.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for dist in closure(names):
        for entry in _top_levels(dist):
            target = tmp / entry.name
            if not target.exists():
                target.symlink_to(entry)
    (tmp / "IMAGE").write_text("\n".join(sorted(names)) + "\n")
    try:
        tmp.rename(layer)
    except OSError:  # another instance built it first
        shutil.rmtree(tmp, ignore_errors=True)
    return layer


def container_python(layer: Path, where: Path) -> Path:
    """A fresh environment at `where` that sees the stdlib and `layer` only; its bin directory."""
    shutil.rmtree(where, ignore_errors=True)
    base = Path(getattr(sys, "_base_executable", sys.executable))
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    bindir = where / "bin"
    site = where / "lib" / version / "site-packages"
    bindir.mkdir(parents=True)
    site.mkdir(parents=True)
    for name in ("python", "python3", version):
        (bindir / name).symlink_to(base)
    (where / "pyvenv.cfg").write_text(f"home = {base.parent}\ninclude-system-site-packages = false\n"
                                      f"version = {sysconfig.get_python_version()}\n")
    # processed at start-up like any .pth: the layer becomes a site directory (its own .pth files run)
    (site / "_image_layer.pth").write_text(f"import site; site.addsitedir({str(layer)!r})\n")
    return bindir
