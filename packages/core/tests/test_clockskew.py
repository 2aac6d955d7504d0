"""The skewed wall clock tests give replicas (`diloco.bootstrap.clockskew`): read as written, loud when not."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from diloco.bootstrap import clockskew


def test_offsets_and_jumps_are_read_per_rank():
    assert clockskew.parse("0:30, 1:-30,2:0@6:45") == {0: (30.0, None, 30.0), 1: (-30.0, None, -30.0),
                                                       2: (0.0, 6.0, 45.0)}
    assert clockskew.parse("2:0@/tmp/x/jump:45") == {2: (0.0, Path("/tmp/x/jump"), 45.0)}
    assert clockskew.parse("") == {}


@pytest.mark.parametrize("bad", ["0", "x:30", "0:30@6", "0:abc", "0:30@jump:45", "0:30@/tmp/jump"])
def test_a_setting_that_is_not_one_says_what_it_should_be(bad):
    with pytest.raises(ValueError, match=r"DILOCO_FAULT_CLOCK_SKEW: .* is not <rank>:<seconds>"):
        clockskew.parse(bad)


def test_only_the_named_rank_is_skewed_and_only_its_wall_clock(monkeypatch):
    monkeypatch.setattr(time, "time", time.time)  # restored after the test
    monkeypatch.setattr(time, "time_ns", time.time_ns)
    assert not clockskew.install_from_env(3, {"DILOCO_FAULT_CLOCK_SKEW": "0:30"})
    mono = time.monotonic()
    real = time.time()
    assert clockskew.install_from_env(0, {"DILOCO_FAULT_CLOCK_SKEW": "0:30"})
    assert time.time() - real == pytest.approx(30, abs=1) and time.time_ns() / 1e9 - real == pytest.approx(30, abs=1)
    assert time.monotonic() - mono < 1


def test_a_clock_waiting_on_a_file_jumps_once_it_exists_and_stays_jumped(monkeypatch, tmp_path):
    monkeypatch.setattr(time, "time", time.time)
    monkeypatch.setattr(time, "time_ns", time.time_ns)
    real = time.time
    jump = tmp_path / "jump"
    assert clockskew.install_from_env(2, {"DILOCO_FAULT_CLOCK_SKEW": f"2:-30@{jump}:45"})
    assert time.time() - real() == pytest.approx(-30, abs=1)
    jump.touch()
    time.sleep(clockskew.LOOK_EVERY_S * 2)
    assert time.time() - real() == pytest.approx(45, abs=1)
    jump.unlink()  # a jump is not undone
    time.sleep(clockskew.LOOK_EVERY_S * 2)
    assert time.time_ns() / 1e9 - real() == pytest.approx(45, abs=1)
