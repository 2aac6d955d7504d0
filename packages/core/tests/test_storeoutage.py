"""A store that stops answering is waited for (`diloco.store.outage`): which errors are an outage,
how long it is waited for, the clock the rounds' deadlines read, and the one line past the limit.
The errors' texts are obstore's own (captured from obstore 0.12 against a closed port, a proxy
answering 500/503, and moto without the bucket); the clock and the sleeps are fakes."""

from __future__ import annotations

import threading

import pytest

from diloco.supervise.policy import RunState, StoreAway, outcome
from diloco.store.outage import Outage, StoreUnreachable, first_line, is_transient

REFUSED = ("Generic S3 error: Error performing PUT http://127.0.0.1:9/b/p/k in 267.3ms, after 2 retries, "
           "max_retries: 2, retry_timeout: 5s  - HTTP error: error sending request\n\nDebug source:\nGeneric {\n"
           "    store: \"S3\",\n    source: RetryError(")
SERVER_ERROR = ("Generic S3 error: Error performing GET http://127.0.0.1:34307/diloco-test?list-type=2 in 208ms, "
                "after 2 retries, max_retries: 2, retry_timeout: 5s  - Server returned non-2xx status code: 500 "
                "Internal Server Error: <Error><Code>InternalError</Code></Error>")
NO_BUCKET = ("Object at location p/k not found: Error performing PUT http://127.0.0.1:41585/nobucket/p/k in 263ms - "
             "Server returned non-2xx status code: 404 Not Found: <Error><Code>NoSuchBucket</Code></Error>")


class GenericError(Exception):  # obstore.exceptions' names are what is_transient reads
    pass


class PermissionDeniedError(Exception):
    pass


class NotFoundError(FileNotFoundError):
    pass


@pytest.mark.parametrize("exc, transient", [
    (GenericError(REFUSED), True),                          # nothing listening
    (GenericError(SERVER_ERROR), True),                     # 5xx after obstore's retries
    (GenericError("Server returned non-2xx status code: 503 Service Unavailable: SlowDown"), True),
    (GenericError("HTTP error: request or response body error: operation timed out"), True),
    (GenericError("Client error with status 429 Too Many Requests"), True),
    (ConnectionResetError("reset by peer"), True),
    (TimeoutError(), True),
    (NotFoundError(NO_BUCKET), False),                      # the store answered: no such bucket
    (PermissionDeniedError("Client error with status 403 Forbidden: AccessDenied"), False),
    (GenericError("Client error with status 400 Bad Request: InvalidArgument"), False),
    (GenericError("Client error with status 403 Forbidden: SignatureDoesNotMatch"), False),
    (OSError(28, "No space left on device"), True),         # a full disk: someone can free it
    (OSError(122, "Disk quota exceeded"), True),
    (GenericError("Generic LocalFileSystem error: Unable to copy data to file: No space left on device "
                  "(os error 28)"), True),
    (OSError(30, "Read-only file system"), False),          # an answer
    (ValueError("bad key"), False),
])
def test_an_outage_is_an_error_that_says_the_store_did_not_answer(exc, transient):
    assert is_transient(exc) is transient


def test_the_first_line_leaves_obstores_debug_dump_out():
    assert first_line(GenericError(REFUSED)).endswith("error sending request")
    assert first_line(GenericError("")) == "GenericError"


class FakeTime:
    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def flaky(clock: FakeTime, until: float, exc: Exception = GenericError(REFUSED), value: str = "ok"):
    calls = []

    def fn() -> str:
        calls.append(clock.t)
        if clock.t < until:
            clock.t += 0.2  # each failed request takes a little time too
            raise exc
        return value
    return fn, calls


def test_an_outage_shorter_than_the_limit_is_waited_out_and_its_time_is_taken_off_the_clock():
    clock, said = FakeTime(), []
    outage = Outage("s3://b/p", 900, log=said.append, now=clock.now, sleep=clock.sleep)
    before = outage.clock()
    fn, calls = flaky(clock, until=1045.0)
    assert outage.call(fn) == "ok"
    assert 1045.0 <= clock.t < 1045.0 + 11  # waits grow to at most 10 s (+ jitter)
    assert len(calls) > 3 and all(b - a <= 10.7 for a, b in zip(calls, calls[1:]))
    assert outage.gone_for() == 0 and outage.since is None
    assert outage.away_s == pytest.approx(clock.t - 1000.0)
    assert outage.clock() == pytest.approx(before)  # the round clock stood still through the outage
    assert len(said) == 2 and "not serving requests" in said[0] and "up to 900 s" in said[0]
    assert "serves requests again" in said[1]


def test_past_the_limit_the_process_gives_up_with_one_line_naming_the_store():
    clock = FakeTime()
    outage = Outage("s3://bucket/runs", 60, now=clock.now, sleep=clock.sleep)
    fn, _ = flaky(clock, until=10**9)
    with pytest.raises(StoreUnreachable) as err:
        outage.call(fn)
    msg = str(err.value)
    assert "\n" not in msg and "s3://bucket/runs" in msg and "store_outage_limit = 60 s" in msg
    assert ": a request has failed for " in msg
    assert msg.endswith("error sending request") and 60 <= clock.t - 1000.0 < 75


def test_an_answer_is_raised_at_once_and_is_no_outage():
    clock = FakeTime()
    outage = Outage("s3://b/p", 900, now=clock.now, sleep=clock.sleep)
    fn, calls = flaky(clock, until=10**9, exc=PermissionDeniedError("403 Forbidden"))
    with pytest.raises(PermissionDeniedError):
        outage.call(fn)
    assert len(calls) == 1 and outage.since is None and outage.away_s == 0


def test_the_clock_stands_still_while_the_store_is_away_for_every_thread():
    clock = FakeTime()
    outage = Outage("s3://b/p", 900, now=clock.now, sleep=lambda s: None)
    started = threading.Event()

    def away_then_back() -> str:
        if not started.is_set():
            started.set()
            clock.t += 30  # a request that hangs 30 s and fails
            raise GenericError(REFUSED)
        return "ok"

    t0 = outage.clock()
    assert outage.call(away_then_back) == "ok"
    assert outage.clock() == pytest.approx(t0)
    clock.t += 5
    assert outage.clock() == pytest.approx(t0 + 5)  # and runs again once it answers


def test_a_full_disk_refusing_writes_is_not_ended_by_reads_that_succeed():
    clock, said = FakeTime(), []
    outage = Outage("file:///scratch/store", 900, log=said.append, now=clock.now, sleep=lambda s: None)
    full = OSError(28, "No space left on device")
    reads_done = []

    def write() -> str:
        if len(reads_done) < 3:  # other threads read meanwhile, and are served
            clock.t += 10
            reads_done.append(outage.call(lambda: "read"))
            raise full
        return "written"

    t0 = outage.clock()
    assert outage.call(write) == "written"
    assert said[0].startswith("store 'file:///scratch/store' is not serving requests: [Errno 28] No space left")
    assert len(said) == 2 and "serves requests again after 30.0 s" in said[1]  # one outage, not four
    assert outage.clock() == pytest.approx(t0)


@pytest.mark.parametrize("away, state, reason", [
    (None, RunState.HEALTHY, ""),
    (StoreAway(0.0, 900), RunState.HEALTHY, ""),
    (StoreAway(45.0, 900, "the store 's3://b/p'", "error sending request"), RunState.UNHEALTHY, ""),
    (StoreAway(900.0, 900, "the store 's3://b/p'", "error sending request"), RunState.FAILED,
     "the store 's3://b/p' has not answered for 900 s (store_outage_limit = 900 s): error sending request"),
])
def test_the_run_waits_for_its_store_until_the_limit_then_fails_naming_it(away, state, reason):
    o = outcome(2, n_replicas=3, live=3, succeeded=0, waiting=0, given_up=0, alone=False, store_away=away)
    assert (o.state, o.reason) == (state, reason)
