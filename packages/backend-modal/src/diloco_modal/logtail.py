"""The last lines of a sandbox's or a call's output, rebuilt from Modal's log entries.

Modal's `logs.tail(n)` returns the last n *entries*, and an entry is a raw chunk of output as
the container's pipe delivered it: a line can be split over several entries, and an entry can
end one line and start the next. Counting entries as lines cuts the result line (`…JSON`) or the
cause line (`preempted: …`) in half, or leaves them outside the window. So the text is rebuilt:
the chunks of each stream (one container's stdout, stderr or system output) are joined in order
and split on newlines, each line stamped with the time its first chunk arrived, and the streams
merged by that time; the window widens until it holds `n_lines` whole lines or the whole output.
A stream is per container (an entry's last context id, its container's), because the containers
of a clustered call write at the same time: joined per source alone, one container's chunk
landed inside another's line, and the result line (written by container 0) could be cut so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

FIRST_WINDOW = 200  # entries asked for at first, at least
MAX_ENTRIES = 20_000  # the most one tail request may ask Modal for


def _source_lines(chunks: list[Any]) -> list[tuple[Any, str]]:
    """(time its first chunk arrived, text) of each line in one source's chunks."""
    lines: list[list[Any]] = []
    open_line = False  # the last line has not ended yet
    for entry in chunks:
        if not entry.message:
            continue
        parts = entry.message.split("\n")
        for i, part in enumerate(parts):
            if i == 0 and open_line:
                lines[-1][1] += part
            elif part or i < len(parts) - 1:
                lines.append([entry.timestamp, part])
        open_line = parts[-1] != ""
    return [(ts, text) for ts, text in lines]


def lines_of(entries: Iterable[Any], *, whole: bool) -> list[str]:
    """The output lines of `entries` (oldest first), in time order across streams. Unless `whole`
    (the window starts at the output's beginning), each stream's first line may be the end of
    an older line, and is dropped."""
    by_stream: dict[tuple[str, str], list[Any]] = {}
    for entry in entries:
        container = (getattr(entry, "context_ids", None) or [""])[-1]
        by_stream.setdefault((str(container), str(getattr(entry, "source", "stdout"))), []).append(entry)
    stamped = []
    for stream, chunks in by_stream.items():
        lines = _source_lines(chunks)[0 if whole else 1:]
        stamped += [(ts, stream, i, text) for i, (ts, text) in enumerate(lines)]
    stamped.sort(key=lambda s: (s[0], s[1], s[2]))
    return [text for *_, text in stamped]


def tail_text(fetch: Callable[[int], list[Any]], n_lines: int) -> str:
    """The last `n_lines` whole lines of output; `fetch(k)` returns the last k log entries."""
    wanted = max(FIRST_WINDOW, 4 * n_lines)
    while True:
        entries = fetch(wanted)
        whole = len(entries) < wanted
        lines = lines_of(entries, whole=whole)
        if whole or len(lines) >= n_lines or wanted >= MAX_ENTRIES:
            break
        wanted = min(wanted * 4, MAX_ENTRIES)
    lines = lines[-n_lines:]
    return "\n".join(lines) + "\n" if lines else ""
