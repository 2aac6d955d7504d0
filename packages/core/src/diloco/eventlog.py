"""events.jsonl read back, one line at a time: what is not an event the launcher writes is skipped.

The launcher appends one JSON object a line and never rewrites one, but a line can come back as
anything: cut short by a killed launcher, garbage from a full disk or a crash of the machine,
an edit by hand. Every reader (`diloco status`, `logs`, the live display, the timeline) indexes
an event's fields as the launcher wrote them, so a line is an event only if it names itself
and a time a clock could say, holds the fields its kind cannot be read without (`REQUIRED`),
and every field the readers use has the type the launcher gives it (`FIELD_TYPES`); anything
else would be a traceback in whichever reader met it first.
"""

from __future__ import annotations

import json
import math
from typing import Any

NUMBER, INT, TEXT, NONE, LIST = "number", "int", "text", "none", "list of ints"

# An event's time: seconds since the epoch, up to the year 3000 (what a clock can say and the
# displays can turn into a date).
LATEST_T = 32_503_680_000.0

# Fields some events cannot be read without: a round event is shown by its round.
REQUIRED: dict[str, tuple[str, ...]] = {"round": ("round",)}

# The fields readers index, and what each may hold (an event carries those that apply to it).
FIELD_TYPES: dict[str, tuple[str, ...]] = {
    "rank": (INT,), "attempt": (INT,), "round": (INT,), "step": (INT, NONE), "total_steps": (INT, NONE),
    "members": (LIST,), "ranks": (LIST,), "straggler": (INT, NONE), "restarts": (INT,),
    "replicas": (INT,), "pid": (INT, NONE),
    # a NaN loss is kept as the string "nan" (`diloco.statedir.to_json`)
    "loss": (NUMBER, TEXT, NONE), "tokens_per_s": (NUMBER, NONE), "sync_share": (NUMBER, NONE),
    "waited_s": (NUMBER, NONE), "delay": (NUMBER, NONE), "error": (TEXT, NONE), "reason": (TEXT, NONE),
}


def fits(value: Any, kinds: tuple[str, ...]) -> bool:
    """Whether `value` is one of `kinds` (a bool is no number; a number is finite)."""
    for kind in kinds:
        if kind == NONE and value is None:
            return True
        if kind == TEXT and isinstance(value, str):
            return True
        if kind == INT and type(value) is int:
            return True
        if kind == NUMBER and type(value) in (int, float) and math.isfinite(value):
            return True
        if kind == LIST and isinstance(value, list) and all(type(x) is int for x in value):
            return True
    return False


def event_of(line: bytes) -> dict[str, Any] | None:
    """One line of events.jsonl as an event, or None when it is not one (see the module)."""
    try:
        entry = json.loads(line)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past what json reads
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("event"), str) or not fits(entry.get("t"), (NUMBER,)):
        return None
    if not 0 <= entry["t"] <= LATEST_T or not all(k in entry for k in REQUIRED.get(entry["event"], ())):
        return None
    if not all(fits(entry[k], kinds) for k, kinds in FIELD_TYPES.items() if k in entry):
        return None
    return entry
