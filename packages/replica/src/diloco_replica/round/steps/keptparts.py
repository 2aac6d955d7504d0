"""The parts a reducer published, kept for repairs in an unlinked local file, not on the heap.

A reducer keeps the bytes of every part it published until its next round is formed, in case a
reader finds the stored copy corrupt and asks for it again (`repairs.RepairDesk`). That is 1/N of
the model in the transport's encoding (half the model's fp32 bytes at N = 2: for fp32 the kept
blob is a view of the part's running total, which stays alive with it), held through the whole
inner phase, and read almost never. On the heap it was the largest buffer a replica held beside
θ_global and the outer momentum (issue "Billion-parameter rounds": 2.96× the model added on the
host in sync fp32 on the CPU proxy, against a target of 2.5×).

So each part is appended to one file per replica as it is published and read back only when a
repair is asked for: the very bytes first written, which readers verify against the header's
checksum as they did the first time. The writes run on a thread of their own, never on the
reducing threads: a round does not wait for the disk (writing on the reducing threads cost a
synchronous round 14% more blocked time on two cores), and a part is served from memory until it
is written. The heap so holds only what the disk has not taken yet; a disk slower than the rounds
(dirty pages throttled) brings back the old memory, not a round that waits for it. Each new round writes
the file from its start again, over the last round's parts, so the file's pages are allocated
once and reused (emptying it each round and writing it anew cost three times the CPU on a
2-core VM); it keeps the size of the largest round's parts until the replica ends. The
file is unlinked at creation (`tempfile.TemporaryFile`): a replica that dies leaves nothing
behind. It lives in `tempfile.gettempdir()` (`TMPDIR`, else /tmp): on a host whose /tmp is a
tmpfs, point `TMPDIR` at a local disk, or the kept parts stay in memory (as shared memory, not
the replica's own). A part the file cannot take (a full or read-only disk) is kept in memory
instead, as before, and said once: repairs never depend on the disk.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO


@dataclass(frozen=True)
class _Spilled:
    """Where one kept part lies in the file."""

    offset: int
    nbytes: int


class KeptParts:
    """Shard index → (round, the blob published for it), the blobs moved to a local file by a
    writer thread of its own.

    Thread-safe: the reducing threads keep parts while the repair watcher takes them. Lock order:
    `_writing` (held while the file is written or emptied), then `_lock` (the entries and the queue)."""

    def __init__(self, log: Callable[[str], None], directory: str | None = None):
        self._log, self._directory = log, directory
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # work queued, or a write done
        self._writing = threading.Lock()
        self._parts: dict[int, tuple[int, _Spilled | list]] = {}
        self._queue: deque[tuple[int, list]] = deque()  # (shard, blob) not yet written
        self._busy = False  # a write is on its way to the file
        self._file: IO[bytes] | None = None
        self._end = 0  # where the next part is written; back to 0 when the file is emptied
        self._disk_refused = False
        self._closed = False
        self._writer: threading.Thread | None = None

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._parts)

    def keep(self, r: int, j: int, blob: list) -> None:
        """Keep shard j's published blob of round r (a list of buffers, as `wire.pack` gives):
        in memory at once, in the file once the writer has it there."""
        with self._lock:
            self._parts[j] = (r, blob)
            if self._disk_refused or self._closed:
                return
            self._queue.append((j, blob))
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_queued, name="diloco-kept-parts", daemon=True)
                self._writer.start()
            self._changed.notify_all()

    def _write_queued(self) -> None:
        """The writer thread: each queued part into the file, its heap copy then let go."""
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._changed.wait()
                if self._closed:
                    return
            with self._writing:
                with self._lock:
                    if not self._queue:  # emptied by a new round meanwhile
                        continue
                    j, blob = self._queue.popleft()
                    entry = self._parts.get(j)
                    if entry is None or entry[1] is not blob:  # taken for a repair meanwhile
                        self._changed.notify_all()
                        continue
                    self._busy = True
                try:
                    if self._file is None:
                        self._file = tempfile.TemporaryFile(dir=self._directory)
                    offset, nbytes = self._end, sum(memoryview(b).nbytes for b in blob)
                    _write_at(self._file.fileno(), blob, offset)
                    self._end = offset + nbytes
                    failed = None
                except OSError as exc:
                    failed = exc
                    self._log(f"kept parts stay in memory from now on: their local file failed ({exc}); set "
                              f"TMPDIR to a local disk with room for 1/N of the model in the run's transport")
                with self._lock:
                    self._busy = False
                    if failed is not None:
                        self._disk_refused = True
                        self._queue.clear()  # what is queued stays in memory, as it is
                    elif self._parts.get(j, (None, None))[1] is blob:
                        self._parts[j] = (entry[0], _Spilled(offset, nbytes))
                    self._changed.notify_all()
                del blob, entry
            if failed is not None:
                return

    def settle(self) -> None:
        """Wait until every part kept so far is in the file (or the disk refused it)."""
        with self._lock:
            while self._queue or self._busy:
                self._changed.wait()

    @property
    def disk_bytes(self) -> int:
        """The file's size: the largest round's kept parts so far."""
        with self._writing:
            return 0 if self._file is None else os.fstat(self._file.fileno()).st_size

    def by_round(self) -> dict[int, list[int]]:
        """The kept shards, grouped by the round they were published in."""
        grouped: dict[int, list[int]] = {}
        with self._lock:
            for j, (r, _) in self._parts.items():
                grouped.setdefault(r, []).append(j)
        return grouped

    def take(self, j: int) -> list:
        """Shard j's blob, no longer kept (it is being re-published)."""
        with self._lock:
            _, kept = self._parts.pop(j)
            fd = None if self._file is None else self._file.fileno()
        if isinstance(kept, list):
            return kept
        return [_read_at(fd, kept.offset, kept.nbytes)]

    def clear(self) -> None:
        """Forget every kept part (a new round is formed): the next ones are written over them."""
        with self._writing, self._lock:  # no write of the last round's parts is on the file after this
            self._parts.clear()
            self._queue.clear()
            self._end = 0
            self._changed.notify_all()

    def close(self) -> None:
        """Stop the writer and remove the file."""
        with self._lock:
            self._closed = True
            self._parts.clear()
            self._queue.clear()
            self._changed.notify_all()
            writer = self._writer
        if writer is not None:
            writer.join()
        with self._writing:
            if self._file is not None:
                self._file.close()
                self._file = None


def _write_at(fd: int, blob: list, offset: int) -> None:
    """Every buffer of `blob`, back to back from `offset` (short writes resumed)."""
    for buffer in blob:
        view = memoryview(buffer).cast("B")
        while view:
            done = os.pwrite(fd, view, offset)
            view, offset = view[done:], offset + done


def _read_at(fd: int, offset: int, nbytes: int) -> bytes:
    """`nbytes` from `offset`; a file that ends before them is an error, not a short blob."""
    chunks, done = [], 0
    while done < nbytes:
        chunk = os.pread(fd, nbytes - done, offset + done)
        if not chunk:
            raise OSError(f"the kept-parts file ends at {offset + done} bytes, {nbytes - done} short of a kept part")
        chunks.append(chunk)
        done += len(chunk)
    return b"".join(chunks)
