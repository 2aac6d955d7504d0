"""What of a workdir is shipped to a remote replica: chosen once, shown by `dryrun`, shipped exactly.

A backend whose replicas run elsewhere uploads the spec's workdir. Researchers' working trees
hold what must never leave the machine (`.env`, `.aws/credentials`, a `*.pem` key, `.netrc`) at
any depth, and much that need not (git history, virtualenvs, caches, whatever `.gitignore`
names). One selection serves every backend, so the dry run lists exactly what is uploaded:

- `NEVER_SHIPPED` (credentials and keys) is refused at any depth, whatever else says;
- `NOT_SHIPPED` (VCS, virtualenvs, caches) is left out by default;
- every `.gitignore` in the tree applies below its own directory (git's rules: pathspec's
  GitIgnoreSpec, the matcher black and hatch use);
- `[backend] ignore` adds gitignore-style patterns relative to the workdir.

Symbolic links are not followed (a link to `~/.aws` must not ship what it points at).
"""

from __future__ import annotations

import gzip
import io
import os
import tarfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ..errors import UserError

# Credentials and keys, at any depth; no pattern can bring them back.
NEVER_SHIPPED = (".env*", ".aws/", "*.pem", "*.key", "credentials*", ".netrc", ".git-credentials", ".pypirc",
                 ".docker/config.json", ".ssh/", "id_rsa*", "id_ecdsa*", "id_ed25519*")
# Never useful in a container: version control, virtualenvs, caches.
NOT_SHIPPED = (".git/", ".hg/", ".svn/", ".venv/", "venv/", "__pycache__/", "*.pyc", ".mypy_cache/",
               ".pytest_cache/", ".ruff_cache/", ".ipynb_checkpoints/", "node_modules/", ".DS_Store")
GITIGNORE = ".gitignore"


def _spec(lines: Iterable[str]) -> Any:
    import pathspec  # loaded when shipping only: `diloco status` never needs it

    return pathspec.GitIgnoreSpec.from_lines(list(lines))


@dataclass(frozen=True)
class ShippedFile:
    """One file that goes to the replicas: its path relative to the workdir (posix) and size."""

    path: str
    size: int


@dataclass(frozen=True)
class Shipment:
    """The files of `root` that are shipped, decided once (`select_files`)."""

    root: Path
    files: tuple[ShippedFile, ...]
    ignore: tuple[str, ...] = ()
    _paths: frozenset[str] = field(default=frozenset(), repr=False, compare=False)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def includes(self, relpath: str | os.PathLike[str]) -> bool:
        """Whether a file (relative to the root, or absolute under it) is shipped."""
        path = Path(relpath)
        if path.is_absolute():
            try:
                path = path.relative_to(self.root)
            except ValueError:
                return False
        return path.as_posix() in (self._paths or {f.path for f in self.files})

    def summary(self, largest: int = 5) -> dict[str, Any]:
        """What `diloco dryrun` shows: where from, how many files, how many bytes, the largest few."""
        big = sorted(self.files, key=lambda f: (-f.size, f.path))[:largest]
        return {"root": str(self.root), "files": len(self.files), "bytes": self.total_bytes,
                "largest": [{"path": f.path, "bytes": f.size} for f in big], "ignore": list(self.ignore)}

    def write_tar(self, fileobj: IO[bytes]) -> None:
        """A gzip tarball of exactly these files (paths relative to the root, reproducible: sorted,
        no owner names, mtime 0), so the same tree gives the same bytes."""
        with gzip.GzipFile(fileobj=fileobj, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as tar:
            for f in self.files:
                src = self.root / f.path
                info = tarfile.TarInfo(f.path)
                info.size = src.stat().st_size
                info.mode = 0o755 if os.access(src, os.X_OK) else 0o644
                with open(src, "rb") as body:
                    tar.addfile(info, body)

    def tar_bytes(self) -> bytes:
        buf = io.BytesIO()
        self.write_tar(buf)
        return buf.getvalue()


def select_files(root: str | os.PathLike[str], ignore: Sequence[str] = ()) -> Shipment:
    """The shipment of `root`: every regular file not excluded (see the module docstring).

    A workdir that is not a directory, or an `ignore` that is not a list of strings, is a
    UserError naming it.
    """
    base = Path(root).resolve()
    if not base.is_dir():
        raise UserError(f"workdir {str(root)!r} is not a directory: set `workdir` in the spec to the directory "
                        f"holding your code")
    if isinstance(ignore, str) or not all(isinstance(p, str) for p in ignore):
        raise UserError(f"[backend] ignore must be a list of gitignore-style patterns, got {ignore!r}")
    never = _spec(NEVER_SHIPPED)
    default = _spec([*NOT_SHIPPED, *ignore])
    scoped: list[tuple[str, Any]] = []  # (directory prefix, its .gitignore)
    files: list[ShippedFile] = []

    def excluded(rel: str, is_dir: bool) -> bool:
        probe = rel + "/" if is_dir else rel
        if never.match_file(probe) or default.match_file(probe):
            return True
        return any(spec.match_file(probe[len(prefix):]) for prefix, spec in scoped if probe.startswith(prefix))

    for dirpath, dirnames, filenames in os.walk(base, followlinks=False):
        rel_dir = Path(dirpath).relative_to(base).as_posix()
        prefix = "" if rel_dir == "." else rel_dir + "/"
        if GITIGNORE in filenames:
            try:
                lines = (Path(dirpath) / GITIGNORE).read_text(errors="replace").splitlines()
            except OSError:
                lines = []
            scoped.append((prefix, _spec(lines)))
        dirnames[:] = sorted(d for d in dirnames
                             if not os.path.islink(os.path.join(dirpath, d)) and not excluded(prefix + d, True))
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            if os.path.islink(full) or not os.path.isfile(full) or excluded(prefix + name, False):
                continue
            files.append(ShippedFile(prefix + name, os.path.getsize(full)))
    files.sort(key=lambda f: f.path)
    return Shipment(base, tuple(files), tuple(ignore), frozenset(f.path for f in files))
