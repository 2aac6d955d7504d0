"""The restart policy as a table of cases: no processes, no sleeps, no clock."""

from __future__ import annotations

import pytest

from diloco.errors import EXIT_CONFIG, EXIT_PREEMPTED, SpecError
from diloco.policy import Decision, Failure, Peer, RestartSettings, decide

BUG = "ValueError: bad shape (at global step 120)"


def settings(**table) -> RestartSettings:
    return RestartSettings.from_table(table, n_replicas=3)


def failure(exit_code=1, error="killed by SIGKILL (exit code 137)", launched_at=100.0, now=110.0) -> Failure:
    return Failure(exit_code, error, launched_at, now)


def ask(s: RestartSettings, f: Failure, *, restarts=0, restarts_used=0, preemptions_used=0, peers=None) -> Decision:
    return decide(s, f, rank=1, restarts=restarts, restarts_used=restarts_used, preemptions_used=preemptions_used,
                  peers=peers if peers is not None else [Peer(None, False), Peer(None, False)])


def brief(d: Decision) -> tuple:
    return d.action, d.delay, d.preempted, d.reason


def test_defaults_come_from_the_spec_schema_once():
    s = settings()
    assert (s.policy, s.max_restarts, s.max_restarts_per_rank, s.backoff, s.backoff_max, s.min_replicas,
            s.max_preemptions, s.fail_fast_seconds) == ("per-rank", 10, 3, 1.0, 60.0, 3, 50, 900.0)
    assert RestartSettings.from_table({}, 4, relaunches_one_rank=False).policy == "gang"
    assert RestartSettings.from_table({"policy": "never"}, 4, relaunches_one_rank=False).policy == "never"
    with pytest.raises(SpecError, match="restart.backoff"):
        settings(backoff="fast")


@pytest.mark.parametrize("restarts, expected_delay", [(0, 1.0), (1, 2.0), (2, 4.0)])
def test_per_rank_backs_off_exponentially(restarts, expected_delay):
    assert brief(ask(settings(), failure(), restarts=restarts)) == ("relaunch", expected_delay, False, "")


def test_backoff_is_capped():
    assert ask(settings(backoff=10, backoff_max=15, max_restarts_per_rank=9), failure(), restarts=3).delay == 15


@pytest.mark.parametrize("kwargs, reason", [
    ({"restarts": 3}, "restart budget spent"),            # max_restarts_per_rank
    ({"restarts_used": 10}, "restart budget spent"),      # max_restarts for the run
])
def test_budgets_give_a_rank_up(kwargs, reason):
    assert brief(ask(settings(), failure(), **kwargs)) == ("give_up", 0.0, False, reason)


def test_never_gives_up_at_once():
    assert ask(settings(policy="never"), failure()).action == "give_up"
    assert ask(settings(policy="never"), failure(EXIT_PREEMPTED)).reason == "restart policy is never"


def test_a_config_error_fails_the_run():
    d = ask(settings(), failure(EXIT_CONFIG, "store: bucket not found"))
    assert d.action == "fail_run" and "configuration error" in d.reason and "bucket not found" in d.reason


def test_the_same_bug_on_every_rank_soon_after_start_fails_the_run():
    peers = [Peer(BUG, True), Peer(BUG, True)]
    d = ask(settings(), failure(error=f"{BUG}\nTraceback ..."), peers=peers)
    assert d.action == "fail_run" and BUG in d.reason and d.signature == BUG and d.failed_soon


@pytest.mark.parametrize("peers, f", [
    ([Peer(BUG, True), Peer(None, False)], failure(error=BUG)),                  # one rank never failed
    ([Peer(BUG, True), Peer("KeyError: x (at global step 120)", True)], failure(error=BUG)),  # another cause
    ([Peer(BUG, True), Peer(BUG, False)], failure(error=BUG)),                   # one came late
    ([Peer(BUG, True), Peer(BUG, True)], failure(error=BUG, launched_at=0.0, now=1000.0)),   # this one came late
    ([Peer(None, True), Peer(None, True)], failure()),                           # signals carry no step
])
def test_anything_short_of_the_same_bug_everywhere_is_relaunched(peers, f):
    assert ask(settings(), f, peers=peers).action == "relaunch"


def test_gang_restarts_everyone_once_per_failure_until_its_budget_is_spent():
    assert brief(ask(settings(policy="gang"), failure(), restarts_used=2)) == ("gang_restart", 4.0, False, "")
    assert ask(settings(policy="gang"), failure(), restarts_used=10).action == "give_up_all"


def test_a_preemption_spends_only_the_preemption_budget():
    s = settings(max_restarts=0, max_restarts_per_rank=0, backoff=2.0)
    assert ask(s, failure(EXIT_PREEMPTED), restarts=5, restarts_used=5) == \
        Decision("relaunch", delay=2.0, preempted=True)
    assert ask(s, failure(EXIT_PREEMPTED), preemptions_used=50) == \
        Decision("give_up", preempted=True, reason="max_preemptions (50) reached")
    assert ask(settings(policy="gang"), failure(EXIT_PREEMPTED), restarts_used=1) == \
        Decision("gang_restart", delay=2.0, preempted=True)
