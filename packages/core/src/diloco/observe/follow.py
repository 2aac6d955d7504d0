"""Following a run until it ends, from any process: its record (`diloco.api.Run.follow`, what
`diloco status --follow` shows) and one replica's output (`Run.follow_logs`, `diloco logs
--follow`).

Both poll (the record on disk, the backend) instead of listening to the launcher, so a follower
sees the same run whoever supervises it and wherever; and a run whose launcher died, which
would never end by itself, stops its follower with the fix instead of holding it forever.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import UserError
from ..runrecord.state import RunRecord


def follow_record(read: Callable[[], RunRecord], supervised: Callable[[RunRecord], bool], *,
                  interval: float) -> Iterator[RunRecord]:
    """Each `read()` of a run's record, every `interval` seconds, until one is final (yielded
    last). Raises UserError once no launcher supervises the run (`supervised`) and its record
    has not changed for `HEARTBEAT_STALE` seconds."""
    from ..supervise.supervisor import HEARTBEAT_STALE

    while True:
        record = read()
        yield record
        if record.ended:
            return
        if not supervised(record) and time.time() - record.updated_at > HEARTBEAT_STALE:
            raise UserError(f"no launcher is supervising run {record.run_id}; progress stopped at its last "
                            f"event (diloco resume {record.run_id})")
        time.sleep(interval)


def follow_output(executor: Any, handle: Any, *, lines: int) -> Iterator[str]:
    """A replica's last `lines` of output, then what it adds, until it ends. A backend whose
    logs are files here (`capabilities.log_files`) is read from where the file ended; any other
    is asked for its tail every second, what is new yielded (only the last line where the tail
    no longer starts with what was seen: older lines fell off it)."""
    if executor.capabilities.log_files:
        yield from _follow_file(executor, handle, lines)
        return
    seen = executor.stream_logs(handle, n_lines=lines)
    if seen:
        yield seen
    while not executor.poll(handle).is_terminal:
        time.sleep(1.0)
        text = executor.stream_logs(handle, n_lines=lines)
        new = "".join(text[len(seen):] if text.startswith(seen) else text.splitlines(keepends=True)[-1:])
        if new:
            yield new
        seen = text


def _follow_file(executor: Any, handle: Any, lines: int) -> Iterator[str]:
    """A log file's last `lines`, then what is appended from where that read ended (one open:
    a line written meanwhile is in one or the other), until the replica ends."""
    from ..local.executor import tail_and_size

    log_path = executor.log_path(handle)
    try:
        tail, pos = tail_and_size(log_path, lines)
    except FileNotFoundError:
        tail, pos = "", 0  # no output yet: all of it, once it comes
    if tail:
        yield tail
    while True:
        done = executor.poll(handle).is_terminal
        if log_path.exists():
            with open(log_path, "rb") as f:
                f.seek(pos)
                chunk = f.read()
                pos += len(chunk)
            if chunk:
                yield chunk.decode("utf-8", "replace")
        if done:
            return
        time.sleep(0.2)
