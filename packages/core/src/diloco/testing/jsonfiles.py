"""JSON files the test doubles keep their state in, which any process (and any thread) may
read while another writes: written to a temporary name and renamed, read with a default."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def read_json(path: Path, default: Any = None) -> Any:
    """The file's data, or `default` if it is missing or half-written."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default
