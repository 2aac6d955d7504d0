"""The parts a reducer keeps for repairs: in a local file, the very bytes back, the heap freed,
memory only where the disk refuses."""

import gc
import os
import threading
import weakref

import pytest
import torch

from diloco_replica.round.steps.keptparts import KeptParts
from diloco_replica.transport.wire import Identity, joined, pack


def _blob(seed: int, numel: int = 1000) -> tuple[list, torch.Tensor]:
    """A published part as `wire.pack` gives it: a header, then a view of the values (no copy)."""
    values = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    blob = pack(Identity("run", 3, "reduced", seed, seed, 0), [memoryview(values.numpy())], codec="fp32",
                numel=numel)
    return blob, values


def test_a_kept_part_comes_back_as_the_very_bytes_published_and_the_heap_no_longer_holds_it(tmp_path):
    lines: list[str] = []
    kept = KeptParts(lines.append, str(tmp_path))
    blob, values = _blob(1)
    expected = joined(blob)
    alive = weakref.ref(values)
    kept.keep(3, 1, blob)
    del blob, values
    kept.settle()
    gc.collect()
    assert alive() is None, "the part's values are still referenced: kept on the heap, not in the file"
    assert kept.by_round() == {3: [1]}
    assert joined(kept.take(1)) == expected
    assert not kept and kept.by_round() == {}
    assert not lines


def test_parts_written_side_by_side_each_come_back_whole(tmp_path):
    kept = KeptParts(print, str(tmp_path))
    blobs = {j: _blob(j, numel=5000 + j)[0] for j in range(16)}
    expected = {j: joined(b) for j, b in blobs.items()}
    threads = [threading.Thread(target=kept.keep, args=(7 if j % 2 else 8, j, blobs[j])) for j in blobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    kept.settle()
    assert {r: sorted(js) for r, js in kept.by_round().items()} == {7: list(range(1, 16, 2)),
                                                                     8: list(range(0, 16, 2))}
    for j in (5, 0, 15, 8):
        assert joined(kept.take(j)) == expected[j]
    assert sorted(j for js in kept.by_round().values() for j in js) == sorted(set(blobs) - {5, 0, 15, 8})


def test_a_new_round_writes_over_the_last_ones_parts_and_a_closed_file_is_gone(tmp_path):
    kept = KeptParts(print, str(tmp_path))
    first, second = _blob(0)[0], _blob(1)[0]
    kept.keep(1, 0, first)
    kept.keep(1, 1, second)
    kept.settle()
    size = len(joined(first)) + len(joined(second))
    assert kept.disk_bytes == size
    kept.clear()
    assert not kept
    third = _blob(2)[0]
    kept.keep(2, 0, third)  # written from the start again, over round 1's parts
    kept.settle()
    assert kept.disk_bytes == size and kept.by_round() == {2: [0]}
    assert joined(kept.take(0)) == joined(third)
    kept.close()
    assert not kept and os.listdir(tmp_path) == []  # unlinked from the start: nothing left behind


@pytest.mark.parametrize("refusal", ["no directory", "full disk"])
def test_a_disk_that_refuses_keeps_the_parts_in_memory_said_once(tmp_path, monkeypatch, refusal):
    lines: list[str] = []
    if refusal == "no directory":
        kept = KeptParts(lines.append, str(tmp_path / "missing"))
    else:
        kept = KeptParts(lines.append, str(tmp_path))

        def full(fd, data, offset):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(os, "pwrite", full)
    blobs = [_blob(j)[0] for j in range(3)]
    for j, blob in enumerate(blobs):
        kept.keep(4, j, blob)
    kept.settle()
    assert len(lines) == 1 and "kept parts stay in memory" in lines[0] and "TMPDIR" in lines[0]
    for j, blob in enumerate(blobs):
        assert kept.take(j) is blob
    assert not kept


def test_a_kept_file_cut_short_is_an_error_not_a_short_part(tmp_path, monkeypatch):
    kept = KeptParts(print, str(tmp_path))
    kept.keep(1, 0, _blob(0)[0])
    kept.settle()
    monkeypatch.setattr(os, "pread", lambda fd, n, offset: b"" if offset >= 100 else b"x" * min(n, 100 - offset))
    with pytest.raises(OSError, match="short of a kept part"):
        kept.take(0)


def test_a_part_asked_for_before_the_writer_had_it_comes_from_memory_and_is_not_written(tmp_path, monkeypatch):
    """The round never waits for the disk: a part is kept in memory at once and served from there
    until it is in the file; one taken meanwhile is not written after all."""
    kept = KeptParts(print, str(tmp_path))
    gate, writes = threading.Event(), []
    pwrite = os.pwrite

    def slow(fd, data, offset):
        gate.wait()
        writes.append(offset)
        return pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", slow)
    first, second = _blob(0)[0], _blob(1)[0]
    kept.keep(1, 0, first)  # the writer takes it and waits on the gate
    kept.keep(1, 1, second)
    assert kept.take(1) is second  # not written yet: the very buffers, from memory
    gate.set()
    kept.settle()
    assert max(writes) < len(joined(first)) == kept.disk_bytes  # the taken part was never written
    assert joined(kept.take(0)) == joined(first)
