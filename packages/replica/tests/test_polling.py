"""`diloco_replica.round.polling.Poll`, the one wait of the round protocol, on a fake clock: when it
looks, how long it sleeps between looks, when it gives up, and what renew / extend / final_look
/ wake change. Table-tested: each row is a wait and the looks and sleeps it must make."""

from __future__ import annotations

import random
import threading

import pytest

from diloco_replica.round.polling import GROWTH, JITTER, Poll


class FakeClock:
    """Time that moves only when the poll sleeps (or a test says so)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float, wake: threading.Event | None) -> bool:
        self.sleeps.append(round(seconds, 6))
        self.now += seconds
        return wake is not None and wake.is_set()


def poll(clock: FakeClock, **how) -> Poll:
    settings = {"first": 0.1, "cap": 0.4, "timeout": 1.0, "jitter": 0.0, "sleep": clock.sleep, **how}
    return Poll("the test's objects", clock=clock, **settings)


def looks_of(p: Poll, clock: FakeClock, arrives_at: float | None = None) -> list[tuple[int, float]]:
    """Iterate `p` until the object (arriving at `arrives_at` on the clock) is seen: (look, time) each."""
    seen = []
    for look in p:
        seen.append((look, round(clock.now - 100.0, 6)))
        if arrives_at is not None and clock.now - 100.0 >= arrives_at:
            break
    return seen


@pytest.mark.parametrize("arrives_at, looks, sleeps", [
    # there at once: one look, no sleep
    (0.0, [(0, 0.0)], []),
    # the waits grow ×1.5 up to the cap (0.1, 0.15, 0.225, 0.3375, then 0.4)
    (0.5, [(0, 0.0), (1, 0.1), (2, 0.25), (3, 0.475), (4, 0.8125)], [0.1, 0.15, 0.225, 0.3375]),
    # never arrives: the last sleep is cut to the deadline, and the last look is at the deadline
    (None, [(0, 0.0), (1, 0.1), (2, 0.25), (3, 0.475), (4, 0.8125), (5, 1.0)],
     [0.1, 0.15, 0.225, 0.3375, 0.1875]),
])
def test_a_wait_looks_at_once_then_after_growing_sleeps_until_the_deadline(arrives_at, looks, sleeps):
    clock = FakeClock()
    assert looks_of(poll(clock), clock, arrives_at) == looks
    assert clock.sleeps == sleeps
    assert GROWTH == 1.5


def test_the_waits_stop_growing_at_the_cap():
    clock = FakeClock()
    looks_of(poll(clock, timeout=5.0), clock)
    assert max(clock.sleeps) == 0.4 and clock.sleeps.count(0.4) >= 8


@pytest.mark.parametrize("final_look", [False, True])
def test_final_look_looks_at_the_deadline_when_the_callers_work_outlasted_it(final_look):
    clock = FakeClock()
    seen = []
    for look in poll(clock, final_look=final_look):
        seen.append((look, round(clock.now - 100.0, 6)))
        if look == 2:
            clock.now += 5.0  # the caller's own work between looks ran past the deadline
    assert seen[-1] == ((3, 5.25) if final_look else (2, 0.25))


def test_final_look_adds_no_look_when_the_last_sleep_ended_at_the_deadline():
    clock = FakeClock()
    assert looks_of(poll(clock, final_look=True), clock)[-1] == (5, 1.0)


def test_renew_looks_again_soon_and_moves_the_deadline():
    clock = FakeClock()
    p = poll(clock)
    seen = []
    for look in p:
        seen.append(round(clock.now - 100.0, 6))
        if look == 3:  # something arrived at 0.475 s: the next wait is the first one again,
            p.renew()  # and the deadline is a whole timeout from now
    assert seen[:5] == [0.0, 0.1, 0.25, 0.475, 0.575]
    assert seen[-1] == pytest.approx(1.475) and clock.now - 100.0 == pytest.approx(1.475)


@pytest.mark.parametrize("windows_allowed, expected_end", [(0, 1.0), (1, 2.0), (3, 4.0)])
def test_extend_waits_another_timeout_each_time_it_says_so(windows_allowed, expected_end):
    clock = FakeClock()
    asked = []

    def extend() -> bool:
        asked.append(round(clock.now - 100.0, 6))
        return len(asked) <= windows_allowed

    seen = looks_of(poll(clock, extend=extend), clock)
    assert clock.now - 100.0 == pytest.approx(expected_end)
    assert len(asked) == windows_allowed + 1
    assert asked[0] == 1.0
    assert seen[0] == (0, 0.0)


def test_extend_may_raise_to_end_the_wait():
    clock = FakeClock()

    def extend() -> bool:
        raise TimeoutError("no re-publication")

    with pytest.raises(TimeoutError, match="no re-publication"):
        looks_of(poll(clock, extend=extend), clock)


@pytest.mark.parametrize("when", ["before", "in the body", "during a sleep"])
def test_wake_ends_the_wait_without_extending_or_a_final_look(when):
    clock = FakeClock()
    wake = threading.Event()
    if when == "before":
        wake.set()

    def sleep(seconds: float, event) -> bool:
        clock.now += seconds / 2
        event.set()
        return True

    p = poll(clock, wake=wake, final_look=True, extend=lambda: pytest.fail("a woken wait is not extended"),
             **({"sleep": sleep} if when == "during a sleep" else {}))
    seen = []
    for look in p:
        seen.append(look)
        if when == "in the body":
            wake.set()
    assert seen == [0]


def test_a_clock_that_stands_still_waits_an_outage_out():
    """The round's clock stands still while the store is away: the poll keeps looking, at the cap."""
    clock = FakeClock()
    ticks = 0

    def frozen_sleep(seconds: float, wake) -> bool:
        nonlocal ticks
        ticks += 1
        return False  # time does not move

    p = poll(clock, sleep=frozen_sleep)
    for look in p:
        if look == 50:
            break
    assert ticks == 50 and p.delay == 0.4


@pytest.mark.parametrize("seed", range(5))
def test_jitter_only_shortens_a_wait_by_at_most_a_quarter(seed):
    clock = FakeClock()
    looks_of(poll(clock, jitter=JITTER, rng=random.Random(seed), timeout=3.0), clock)
    schedule = [min(0.1 * GROWTH ** i, 0.4) for i in range(len(clock.sleeps))]
    for jittered, unjittered in zip(clock.sleeps[:-1], schedule):  # (the last is cut to the deadline)
        assert unjittered * (1 - JITTER) - 1e-6 <= jittered <= unjittered + 1e-6
    assert clock.sleeps[:-1] != [round(d, 6) for d in schedule[:-1]]  # it does jitter
    assert clock.now - 100.0 == pytest.approx(3.0)


def test_two_replicas_starting_together_drift_apart():
    first, second = FakeClock(), FakeClock()
    looks_of(poll(first, jitter=JITTER, rng=random.Random(1), timeout=3.0), first)
    looks_of(poll(second, jitter=JITTER, rng=random.Random(2), timeout=3.0), second)
    assert first.sleeps[:5] != second.sleeps[:5]


def test_jitter_outside_0_1_is_refused():
    with pytest.raises(ValueError, match="jitter"):
        poll(FakeClock(), jitter=1.0)
