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
from typing import Any

from ..options import fits

# An event's time: seconds since the epoch, up to the year 3000 (what a clock can say and the
# displays can turn into a date).
LATEST_T = 32_503_680_000.0

# Fields some events cannot be read without: a round event is shown by its round.
REQUIRED: dict[str, tuple[str, ...]] = {"round": ("round",)}

# The fields readers index, and what each may hold (an event carries those that apply to it),
# checked by the one validator of plain values (`diloco.options.fits`: a number is finite, an int
# no bool).
FIELD_TYPES: dict[str, Any] = {
    "rank": int, "attempt": int, "round": int, "step": int | None, "total_steps": int | None,
    "members": list[int], "ranks": list[int], "straggler": int | None, "restarts": int,
    "replicas": int, "pid": int | None,
    # a NaN loss is kept as the string "nan" (`diloco.host.statedir.to_json`)
    "loss": float | str | None, "tokens_per_s": float | None, "sync_share": float | None,
    "waited_s": float | None, "delay": float | None, "error": str | None, "reason": str | None,
}


def event_of(line: bytes) -> dict[str, Any] | None:
    """One line of events.jsonl as an event, or None when it is not one (see the module)."""
    try:
        entry = json.loads(line)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past what json reads
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("event"), str) or not fits(float, entry.get("t")):
        return None
    if not 0 <= entry["t"] <= LATEST_T or not all(k in entry for k in REQUIRED.get(entry["event"], ())):
        return None
    if not all(fits(tp, entry[k]) for k, tp in FIELD_TYPES.items() if k in entry):
        return None
    return entry
