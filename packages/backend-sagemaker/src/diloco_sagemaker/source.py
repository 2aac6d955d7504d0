"""The run's code on S3: the bootstrap and the spec's workdir as one archive, uploaded once per run.

Both go under the job's `diloco` input channel prefix, which SageMaker downloads to
/opt/ml/input/data/diloco/ before the container starts. Uploads are create-only: a relaunch
of rank r at attempt 3 runs the code the run started with, even if the workdir changed since.
"""

from __future__ import annotations

import fnmatch
import io
import os
import tarfile
from pathlib import Path

from diloco.errors import UserError

from . import bootstrap
from .request import BOOTSTRAP_FILE

# Never ship a virtualenv, git history or caches; data belongs in S3, not in the code archive.
IGNORE = [".git", ".venv", "venv", "__pycache__", "*.pyc", ".mypy_cache", ".pytest_cache", "node_modules",
          ".ipynb_checkpoints", ".DS_Store"]
MAX_ARCHIVE_BYTES = 512 << 20


def archive_workdir(workdir: str) -> bytes:
    """A reproducible tar.gz of `workdir` (sorted, zeroed owners and times)."""
    root = Path(workdir)
    if not root.is_dir():
        raise UserError(f"workdir {workdir!r} is not a directory")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if not _ignored(d))
            for name in sorted(filenames):
                if _ignored(name):
                    continue
                path = Path(dirpath) / name
                if path.is_symlink() or not path.is_file():
                    continue
                info = tar.gettarinfo(str(path), arcname=str(path.relative_to(root)))
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                info.mtime = 0
                with open(path, "rb") as f:
                    tar.addfile(info, f)
            if buf.tell() > MAX_ARCHIVE_BYTES:
                raise UserError(f"workdir {workdir!r} packs to more than {MAX_ARCHIVE_BYTES >> 20} MiB: keep data "
                                f"and checkpoints in S3, or set [backend] include_workdir = false and bake the "
                                f"code into the image")
    return buf.getvalue()


def _ignored(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in IGNORE)


def bootstrap_source() -> bytes:
    return Path(bootstrap.__file__).read_bytes()


def split_s3(uri: str) -> tuple[str, str]:
    bucket, _, key = uri[len("s3://"):].partition("/")
    return bucket, key


def upload_code(s3, code_prefix: str, workdir: str | None) -> None:
    """Put the bootstrap and the workdir archive under `code_prefix`, unless already there."""
    from botocore.exceptions import ClientError

    bucket, prefix = split_s3(code_prefix)
    files = {BOOTSTRAP_FILE: bootstrap_source()}
    if workdir:
        files[bootstrap.ARCHIVE] = archive_workdir(workdir)
    for name, body in files.items():
        try:
            s3.put_object(Bucket=bucket, Key=prefix + name, Body=body, IfNoneMatch="*")
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in ("PreconditionFailed", "ConditionalRequestConflict"):
                raise
