"""`python -m diloco_modal.testing.call DIR`: a function call's body inside a container of the double.

Imports the decorated function's module as a Modal container would, and calls the body with
the spawn's arguments (JSON in the double). An exception is printed with its traceback, as
Modal's container runtime logs it, and the call fails.
"""

from __future__ import annotations

import importlib
import sys
import traceback
from pathlib import Path

from .files import _read_json


def main(obj_dir: Path) -> int:
    spec = _read_json(obj_dir / "spec.json")
    from modal._utils.async_utils import synchronizer

    obj = importlib.import_module(spec["module"])
    for part in spec["qualname"].split("."):
        obj = getattr(obj, part)
    body = synchronizer._translate_in(obj)._raw_f if hasattr(obj, "spawn") else obj
    try:
        body(*spec.get("args", []), **spec.get("kwargs", {}))
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
