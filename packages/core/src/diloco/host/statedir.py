"""The state directory and how anything is written in it: private (0700 directories, 0600
files from their first byte), valid JSON only, and atomic where a reader may look mid-write.

Apart from `diloco.runrecord.state` (the run records) because the metrics, sinks and artifacts write
here too, and none of them needs to know what a run record is.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import IO, Any

ENV_STATE_DIR = "DILOCO_STATE_DIR"


def state_dir() -> Path:
    """$DILOCO_STATE_DIR, else the user's state dir (e.g. ~/.local/state/diloco)."""
    override = os.environ.get(ENV_STATE_DIR)
    if override:
        return Path(override).expanduser().resolve()
    import platformdirs

    return Path(platformdirs.user_state_dir("diloco"))


def private_dir(path: Path) -> Path:
    """`path` and each of its missing parents, created 0700 (the state directory is the user's alone)."""
    if not path.is_dir():
        for missing in [*reversed(path.parents), path]:
            if not missing.is_dir():
                missing.mkdir(mode=0o700, exist_ok=True)
    return path


def private_file(path: Path, mode: str = "wb") -> IO[Any]:
    """`path` opened to write ("w"/"wb": from empty, "a"/"ab": appending), created 0600 and in a
    0700 directory. What `open()` creates is 0644 under the usual umask: readable by anyone who
    can reach it, and a log, a round or an artifact may hold what the user alone should read."""
    private_dir(path.parent)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if "a" in mode else os.O_TRUNC)
    return os.fdopen(os.open(path, flags, 0o600), mode)


def _finite(value: Any) -> Any:
    """`value` with every non-finite float as a string, so the document is valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def to_json(data: Any, **kwargs: Any) -> str:
    """Valid JSON always (see `_finite`): what every record and event line is written as."""
    try:
        return json.dumps(data, allow_nan=False, **kwargs)
    except ValueError:
        return json.dumps(_finite(data), allow_nan=False, **kwargs)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write-then-rename, the file 0600 from its first byte."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with private_file(tmp, "w") as f:
        f.write(to_json(data, indent=2, sort_keys=True))
    os.replace(tmp, path)
