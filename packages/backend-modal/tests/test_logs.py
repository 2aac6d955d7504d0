"""Logs: Modal's entries are raw chunks of output, not lines (`diloco_modal.logtail`)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

from diloco.testing import launch
from diloco_modal.executor import ModalExecutor

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
CHATTY = '''
def main(lines=400, payload=3000):
    for i in range(lines):
        print(f"step {i} " + "." * 60, flush=True)
    return {"payload": "y" * payload, "last": lines - 1}
'''


def entry(message, second, source="stdout"):
    return SimpleNamespace(message=message, timestamp=T0 + timedelta(seconds=second), source=source)


def test_lines_are_rebuilt_from_chunks_per_source_and_merged_by_time():
    from diloco_modal.logtail import lines_of

    entries = [entry("he", 0), entry("llo\nwor", 1), entry("boom\n", 2, "stderr"), entry("ld\n", 3),
               entry("\nend", 4)]
    assert lines_of(entries, whole=True) == ["hello", "world", "boom", "", "end"]  # a line sorts by its first chunk
    assert lines_of(entries, whole=False) == ["world", "", "end"]  # each source's first line may be partial


def test_the_tail_widens_until_it_holds_whole_lines():
    from diloco_modal.logtail import tail_text

    text = "".join(f"line {i}\n" for i in range(100))
    chunks = [entry(text[i:i + 3], i) for i in range(0, len(text), 3)]  # 3-character entries
    asked = []

    def fetch(k):
        asked.append(k)
        return chunks[-k:]

    assert tail_text(fetch, 5) == "".join(f"line {i}\n" for i in range(95, 100))
    assert tail_text(fetch, 500) == text  # more lines than there are: the whole output, once
    assert asked[-1] >= len(chunks)


def test_a_long_result_line_split_over_many_entries_is_read_whole(fake_modal, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "chatty.py").write_text(CHATTY)
    executor = ModalExecutor(image="ghcr.io/me/trainer:1")  # an image holding diloco: the logs are the point
    (handle,) = launch(executor, 1, "chatty:main", run_id="r1", workdir=str(work))
    (result,) = executor.collect([handle], timeout=60)
    assert result.status == "succeeded", result.error
    assert result.result == {"payload": "y" * 3000, "last": 399}  # one JSON line of ~3 kB, in ~150 entries
    tail = executor.stream_logs(handle, n_lines=3).splitlines()
    assert len(tail) == 3 and tail[0] == "step 398 " + "." * 60 and tail[-1].startswith("diloco: replica result:")
