"""Wheels of the diloco the launcher runs, for images that must hold exactly it.

diloco is not on a package index, and a replica must run the diloco that planned its run (the
environment contract, the settings schema and the wire format move together). So an image a
backend builds (Modal's default image, SageMaker's `pytorch_version` path) installs wheels made
here, from the distributions installed where `diloco run` runs:

- a regular install (what `pip install diloco-core` leaves): the files its RECORD lists, with
  its own METADATA, entry points and wheel tags;
- an editable install (a checkout, `pip install -e`): the packages its `.pth` points at, as a
  pure-Python wheel with the installed METADATA.

Wheels are reproducible (sorted entries, fixed timestamps): the same installation gives the
same bytes, so an image layer built from them is cached across launches.

`dependency_wheels` does the same for the requirement closure an image lacks, so a container
with no internet (a VPC without NAT) installs with `pip install --no-index --find-links`.
"""

from __future__ import annotations

import base64
import csv
import functools
import hashlib
import io
import json
import os
import re
import zipfile
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

from ..errors import UserError

REPLICA_DISTRIBUTIONS = ("diloco-core", "diloco-replica")
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)
_SKIPPED_META = {"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"}


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _distribution(name: str, needed_by: str | None = None) -> metadata.Distribution:
    try:
        return metadata.distribution(name)
    except metadata.PackageNotFoundError:
        why = f" (needed by {needed_by})" if needed_by else ""
        hint = ("pip install --no-deps diloco-replica next to the launcher: it is packed into the image, not run "
                "here" if normalize(name) == "diloco-replica" else f"pip install {name}")
        raise UserError(f"{name}{why} is not installed where diloco runs, so it cannot be shipped to the "
                        f"replicas: {hint}") from None


def _editable_source(dist: metadata.Distribution) -> list[Path] | None:
    """The directories an editable install puts on sys.path, or None for a regular install."""
    text = dist.read_text("direct_url.json")
    try:
        editable = bool(json.loads(text or "{}").get("dir_info", {}).get("editable"))
    except ValueError:
        editable = False
    if not editable:
        return None
    roots = []
    for f in dist.files or []:
        if f.name.endswith(".pth"):
            for line in (f.read_text() or "").splitlines():
                line = line.strip()
                if line and not line.startswith(("#", "import ")) and Path(line).is_dir():
                    roots.append(Path(line))
    if not roots:
        raise UserError(f"{dist.metadata['Name']} is installed in editable mode in a way diloco cannot pack "
                        f"(no source directory in its .pth): reinstall it with `pip install -e` or without -e")
    return roots


def _top_level(dist: metadata.Distribution, root: Path) -> list[Path]:
    """The importable packages and modules of an editable distribution under `root`."""
    found = [p for p in sorted(root.iterdir()) if not p.name.startswith(".")]
    return [p for p in found if (p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py"]


def _tags(dist: metadata.Distribution) -> str:
    """The wheel tag of the filename, from the installed WHEEL file (py3-none-any when absent)."""
    tags = [line.split(":", 1)[1].strip() for line in (dist.read_text("WHEEL") or "").splitlines()
            if line.startswith("Tag:")]
    if not tags:
        return "py3-none-any"
    parts = [t.split("-") for t in tags]
    return "-".join(".".join(dict.fromkeys(p[i] for p in parts)) for i in range(3))


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _payload(dist: metadata.Distribution) -> dict[str, bytes]:
    """{archive path: bytes} of the distribution's own files (no dist-info, no scripts, no caches)."""
    out: dict[str, bytes] = {}
    sources = _editable_source(dist)
    if sources is not None:
        for root in sources:
            for top in _top_level(dist, root):
                paths = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file())
                for path in paths:
                    rel = path.relative_to(root).as_posix()
                    if "__pycache__" not in rel and not rel.endswith((".pyc", ".pyo")):
                        out[rel] = path.read_bytes()
        return out
    for f in dist.files or []:
        rel = f.as_posix()
        if rel.startswith("..") or "__pycache__" in rel or rel.endswith((".pyc", ".pyo")) or ".dist-info/" in rel:
            continue
        out[rel] = Path(dist.locate_file(f)).read_bytes()
    return out


def build_wheel(name: str, dest: str | os.PathLike[str], *, needed_by: str | None = None) -> Path:
    """The wheel of installed distribution `name`, written into `dest` (see the module docstring)."""
    dist = _distribution(name, needed_by)
    dist_name, version = dist.metadata["Name"], dist.version
    stem = f"{normalize(dist_name).replace('-', '_')}-{version}"
    editable = _editable_source(dist) is not None
    tag = "py3-none-any" if editable else _tags(dist)
    info = f"{stem}.dist-info"
    files = _payload(dist)
    files[f"{info}/METADATA"] = (dist.read_text("METADATA") or "").encode()
    for extra in ("entry_points.txt", "top_level.txt"):
        text = dist.read_text(extra)
        if text:
            files[f"{info}/{extra}"] = text.encode()
    purelib = "true" if tag.endswith("-none-any") else "false"
    files[f"{info}/WHEEL"] = ("Wheel-Version: 1.0\nGenerator: diloco.shipping.wheelhouse\nRoot-Is-Purelib: "
                              f"{purelib}\n" + "".join(f"Tag: {t}\n" for t in _expand(tag))).encode()
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    for path in sorted(files):
        writer.writerow([path, _record_hash(files[path]), len(files[path])])
    writer.writerow([f"{info}/RECORD", "", ""])
    files[f"{info}/RECORD"] = record.getvalue().encode()
    out = Path(dest) / f"{stem}-{tag}.whl"
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for path in sorted(files):
            entry = zipfile.ZipInfo(path, date_time=_ZIP_TIME)
            entry.external_attr = 0o644 << 16
            entry.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(entry, files[path])
    return out


def _expand(tag: str) -> list[str]:
    pys, abis, plats = (part.split(".") for part in tag.split("-"))
    return [f"{a}-{b}-{c}" for a in pys for b in abis for c in plats]


def launcher_wheels(dest: str | os.PathLike[str]) -> list[Path]:
    """Wheels of diloco-core and diloco-replica exactly as installed here (the replica's diloco)."""
    return [build_wheel(name, dest) for name in REPLICA_DISTRIBUTIONS]


def _requirements(dist: metadata.Distribution, extras: Iterable[str] = ()) -> list[tuple[str, tuple[str, ...]]]:
    """(name, extras) of what `dist` needs on this platform, with the given extras."""
    from packaging.requirements import Requirement

    out = []
    for text in dist.requires or []:
        req = Requirement(text)
        wanted = ("", *extras)
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in wanted):
            continue
        out.append((req.name, tuple(sorted(req.extras))))
    return out


def dependency_wheels(dest: str | os.PathLike[str], *, exclude: Iterable[str] = (),
                      roots: Iterable[str] = REPLICA_DISTRIBUTIONS) -> list[Path]:
    """Wheels of everything `roots` need, transitively, as installed here, except `exclude`
    (distributions the image already holds, e.g. torch and numpy, with what they need)."""
    skip = {normalize(n) for n in exclude} | {normalize(n) for n in roots}
    queue = [(name, ()) for name in roots]
    seen: dict[str, set[str]] = {}
    wheels: list[Path] = []
    while queue:
        name, extras = queue.pop(0)
        dist = _distribution(name)
        for dep, dep_extras in _requirements(dist, extras):
            key = normalize(dep)
            first = key not in seen
            if key in skip or (not first and set(dep_extras) <= seen[key]):
                continue
            seen.setdefault(key, set()).update(dep_extras)
            if first:
                wheels.append(build_wheel(dep, dest, needed_by=dist.metadata["Name"]))
            queue.append((dep, dep_extras))
    return wheels


def fetch_wheel(name: str, version: str, dest: str | os.PathLike[str], *, python: str,
                platform: str) -> Path | None:
    """The published wheel of `name`==`version` for CPython `python` on `platform`, from the package
    index pip is configured with; None if pip cannot get one.

    A native dependency installed here is built for this machine's Python (xxhash's wheels are
    per CPython version, unlike obstore's abi3 one), so an image with another Python needs the
    index's build of the same version."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(prefix="diloco-fetch-") as tmp:
        platforms = [arg for p in _manylinux_platforms(platform) for arg in ("--platform", p)]
        try:
            done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                                   "--disable-pip-version-check", "--python-version", python, *platforms, "-d", tmp,
                                   f"{name}=={version}"], capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired):
            return None
        found = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not found or not wheel_fits(found[0], python=python, platform=platform):
            return None
        out = Path(dest) / found[0].name
        out.write_bytes(found[0].read_bytes())
        return out


def _manylinux_platforms(platform: str) -> list[str]:
    """Every platform tag a `manylinux_2_X_ARCH` system installs (and the legacy aliases)."""
    m = re.fullmatch(r"manylinux_(\d+)_(\d+)_(\w+)", platform)
    if not m:
        return [platform]
    major, minor, arch = int(m[1]), int(m[2]), m[3]
    out = [f"manylinux_{major}_{x}_{arch}" for x in range(minor, -1, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    out += [f"{name}_{arch}" for x, name in legacy.items() if major == 2 and x <= minor]
    return [*out, f"linux_{arch}"]


def wheel_fits(path: str | os.PathLike[str], python: str = "3.11",
               platform: str = "manylinux_2_17_x86_64") -> bool:
    """Whether a wheel installs on CPython `python` on `platform` (its tags and Requires-Python)."""
    from packaging import tags as t
    from packaging.specifiers import SpecifierSet
    from packaging.utils import parse_wheel_filename

    version = tuple(int(x) for x in python.split(".")[:2])
    _, _, _, wheel_tags = parse_wheel_filename(Path(path).name)
    platforms = _manylinux_platforms(platform)
    supported = {*t.cpython_tags(version, platforms=platforms),
                 *t.compatible_tags(version, f"cp{version[0]}{version[1]}", platforms)}
    if not wheel_tags & supported:
        return False
    with zipfile.ZipFile(path) as zf:
        meta = next((n for n in zf.namelist() if n.endswith(".dist-info/METADATA")), None)
        text = zf.read(meta).decode() if meta else ""
    requires = next((line.split(":", 1)[1].strip() for line in text.splitlines()
                     if line.startswith("Requires-Python:")), "")
    return not requires or SpecifierSet(requires).contains(python, prereleases=True)


@functools.cache
def run_versions() -> str:
    """DILOCO_VERSION: the diloco distributions installed where the run is launched, as
    'diloco-core==X diloco-replica==Y' (those installed here); a replica holding others stops."""
    found = []
    for name in REPLICA_DISTRIBUTIONS:
        try:
            found.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return " ".join(found)
