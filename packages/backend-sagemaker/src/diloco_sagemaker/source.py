"""The run's code on S3, uploaded once per run under the job's `diloco` input channel prefix.

SageMaker downloads that prefix to /opt/ml/input/data/diloco/ before the container starts:

- `bootstrap.py` and `secretsreader.py` (standard library only: the container's first steps);
- `source.tar.gz`: the workdir's shipped files, chosen by `diloco.shipping.workdir` exactly as the plan
  showed them (never `.env*`, `.aws/`, keys or credentials at any depth; `.gitignore` honoured);
- `env-<hash>.json`: environment values longer than SageMaker allows (`environment`);
- `wheels/`: diloco and what an official PyTorch image lacks (`officialimage`).

Uploads are create-only: a relaunch of rank r at attempt 3 runs the code the run started with,
even if the workdir changed since.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from . import bootstrap, secretsreader
from .bootstrap import WHEELS_DIR
from .trainingjob import BOOTSTRAP_FILE, SECRETS_READER_FILE


def split_s3(uri: str) -> tuple[str, str]:
    bucket, _, key = uri[len("s3://"):].partition("/")
    return bucket, key


def put_once(s3: Any, bucket: str, key: str, body: bytes) -> None:
    """Create `key` unless it exists (a relaunch keeps the run's first upload)."""
    from botocore.exceptions import ClientError

    try:
        s3.put_object(Bucket=bucket, Key=key, Body=body, IfNoneMatch="*")
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") not in ("PreconditionFailed", "ConditionalRequestConflict"):
            raise


def upload_code(s3: Any, code: dict[str, Any], ignore: list[str]) -> None:
    """Put everything the plan's `code` section names under its prefix."""
    bucket, prefix = split_s3(code["s3_uri"])
    files = {BOOTSTRAP_FILE: Path(bootstrap.__file__).read_bytes(),
             SECRETS_READER_FILE: Path(secretsreader.__file__).read_bytes()}
    if code.get("workdir"):
        from diloco.shipping.workdir import select_files

        files[bootstrap.ARCHIVE] = select_files(code["workdir"], ignore=ignore).tar_bytes()
    for name, values in (code.get("env_files") or {}).items():
        files[name] = json.dumps(values, sort_keys=True).encode()
    for name, body in files.items():
        put_once(s3, bucket, prefix + name, body)
    if code.get("wheels"):
        from .officialimage import build_wheels

        with tempfile.TemporaryDirectory(prefix="diloco-wheels-") as tmp:
            for wheel in build_wheels(Path(tmp), code["wheels"].get("python")):
                put_once(s3, bucket, f"{prefix}{WHEELS_DIR}/{wheel.name}", wheel.read_bytes())
