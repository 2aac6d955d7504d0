"""The restart policy as tables of cases: no processes, no sleeps, no clock."""

from __future__ import annotations

import pytest

from diloco.errors import EXIT_CONFIG, EXIT_PREEMPTED, SpecError
from diloco.policy import (Action, Decision, Failure, Peer, RestartSettings, RunState, Spend, decide, outcome,
                           spent_on_decision, spent_on_relaunch)

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
    assert brief(ask(settings(), failure(), restarts=restarts)) == (Action.RELAUNCH, expected_delay, False, "")


def test_backoff_is_capped():
    assert ask(settings(backoff=10, backoff_max=15, max_restarts_per_rank=9), failure(), restarts=3).delay == 15


@pytest.mark.parametrize("kwargs, reason", [
    ({"restarts": 3}, "restart budget spent"),            # max_restarts_per_rank
    ({"restarts_used": 10}, "restart budget spent"),      # max_restarts for the run
])
def test_budgets_give_a_rank_up(kwargs, reason):
    assert brief(ask(settings(), failure(), **kwargs)) == (Action.GIVE_UP, 0.0, False, reason)


def test_never_gives_up_at_once():
    assert ask(settings(policy="never"), failure()).action is Action.GIVE_UP
    assert ask(settings(policy="never"), failure(EXIT_PREEMPTED)).reason == "restart policy is never"


def test_a_config_error_fails_the_run():
    d = ask(settings(), failure(EXIT_CONFIG, "store: bucket not found"))
    assert d.action is Action.FAIL_RUN and "configuration error" in d.reason and "bucket not found" in d.reason


def test_the_same_bug_on_every_rank_soon_after_start_fails_the_run():
    peers = [Peer(BUG, True), Peer(BUG, True)]
    d = ask(settings(), failure(error=f"{BUG}\nTraceback ..."), peers=peers)
    assert d.action is Action.FAIL_RUN and BUG in d.reason and d.signature == BUG and d.failed_soon


@pytest.mark.parametrize("peers, f", [
    ([Peer(BUG, True), Peer(None, False)], failure(error=BUG)),                  # one rank never failed
    ([Peer(BUG, True), Peer("KeyError: x (at global step 120)", True)], failure(error=BUG)),  # another cause
    ([Peer(BUG, True), Peer(BUG, False)], failure(error=BUG)),                   # one came late
    ([Peer(BUG, True), Peer(BUG, True)], failure(error=BUG, launched_at=0.0, now=1000.0)),   # this one came late
    ([Peer(None, True), Peer(None, True)], failure()),                           # signals carry no step
])
def test_anything_short_of_the_same_bug_everywhere_is_relaunched(peers, f):
    assert ask(settings(), f, peers=peers).action is Action.RELAUNCH


def test_gang_restarts_everyone_once_per_failure_until_its_budget_is_spent():
    assert brief(ask(settings(policy="gang"), failure(), restarts_used=2)) == (Action.GANG_RESTART, 4.0, False, "")
    assert ask(settings(policy="gang"), failure(), restarts_used=10).action is Action.GIVE_UP_ALL


def test_a_preemption_spends_only_the_preemption_budget():
    s = settings(max_restarts=0, max_restarts_per_rank=0, backoff=2.0)
    assert ask(s, failure(EXIT_PREEMPTED), restarts=5, restarts_used=5) == \
        Decision(Action.RELAUNCH, delay=2.0, preempted=True)
    assert ask(s, failure(EXIT_PREEMPTED), preemptions_used=50) == \
        Decision(Action.GIVE_UP, preempted=True, reason="max_preemptions (50) reached")
    assert ask(settings(policy="gang"), failure(EXIT_PREEMPTED), restarts_used=1) == \
        Decision(Action.GANG_RESTART, delay=2.0, preempted=True)



@pytest.mark.parametrize("exit_code, error, preempted", [
    (EXIT_PREEMPTED, "preempted: the platform sent SIGINT to take the replica's machine away", True),
    # killed at the end of the platform's grace period, after the runner took the notice
    (137, "preempted: the platform sent SIGUSR1 to take the replica's machine away\nlast output:\n...", True),
    (137, "\n  preempted: the platform sent SIGTERM to take the replica's machine away", True),
    (137, "killed by SIGKILL (exit code 137)\npreempted: the platform sent SIGINT ...", False),  # not its cause
    (1, "ValueError: preempted: the platform sent SIGINT (at global step 3)", False),
    (137, None, False),
])
def test_a_replica_killed_after_taking_the_preemption_notice_is_preempted(exit_code, error, preempted):
    d = ask(settings(max_restarts_per_rank=0), failure(exit_code, error))
    assert (d.preempted, d.action) == (preempted, Action.RELAUNCH if preempted else Action.GIVE_UP)

# -- budgets: what each answer spends, and when ----------------------------------------------

@pytest.mark.parametrize("table, f, kwargs, action, spent", [
    ({}, failure(), {}, Action.RELAUNCH, Spend()),  # paid when launched, not when decided
    ({}, failure(EXIT_PREEMPTED), {}, Action.RELAUNCH, Spend(preemptions=1)),
    ({"policy": "gang"}, failure(), {}, Action.GANG_RESTART, Spend(run_restarts=1)),  # once, not once per rank
    ({"policy": "gang"}, failure(EXIT_PREEMPTED), {}, Action.GANG_RESTART, Spend(preemptions=1)),
    ({}, failure(), {"restarts": 3}, Action.GIVE_UP, Spend()),
    ({"policy": "never"}, failure(EXIT_PREEMPTED), {}, Action.GIVE_UP, Spend()),
    ({}, failure(EXIT_PREEMPTED), {"preemptions_used": 50}, Action.GIVE_UP, Spend()),
    ({"policy": "gang"}, failure(), {"restarts_used": 10}, Action.GIVE_UP_ALL, Spend()),
    ({}, failure(EXIT_CONFIG), {}, Action.FAIL_RUN, Spend()),
])
def test_what_a_decision_spends_at_once(table, f, kwargs, action, spent):
    d = ask(settings(**table), f, **kwargs)
    assert (d.action, spent_on_decision(d)) == (action, spent)


@pytest.mark.parametrize("policy, preempted, spent", [
    ("per-rank", False, Spend(restarts=1, run_restarts=1)),
    ("per-rank", True, Spend()),            # paid from max_preemptions when decided
    ("gang", False, Spend(restarts=1)),     # the run's restart was paid once, when decided
    ("gang", True, Spend()),
])
def test_what_a_relaunch_spends_when_launched(policy, preempted, spent):
    assert spent_on_relaunch(policy, preempted=preempted) == spent


def relaunches_until_spent(s: RestartSettings, exit_code: int) -> tuple[int, Action]:
    """One rank failing on every attempt: how many relaunches its budgets pay for, and the last answer."""
    restarts = run_restarts = preemptions = 0
    for n in range(100):
        d = ask(s, failure(exit_code), restarts=restarts, restarts_used=run_restarts, preemptions_used=preemptions)
        if d.action not in (Action.RELAUNCH, Action.GANG_RESTART):
            return n, d.action
        for spent in (spent_on_decision(d), spent_on_relaunch(s.policy, preempted=d.preempted)):
            restarts, run_restarts = restarts + spent.restarts, run_restarts + spent.run_restarts
            preemptions += spent.preemptions
    raise AssertionError("the budgets never ran out")


@pytest.mark.parametrize("table, exit_code, relaunches, last", [
    ({}, 1, 3, Action.GIVE_UP),                                            # max_restarts_per_rank
    ({"max_restarts": 2}, 1, 2, Action.GIVE_UP),                           # the run's budget, first
    ({"max_restarts": 0}, 1, 0, Action.GIVE_UP),                           # none at all
    ({"policy": "gang", "max_restarts": 2}, 1, 2, Action.GIVE_UP_ALL),
    ({"policy": "gang", "max_restarts": 2, "max_restarts_per_rank": 0}, 1, 2, Action.GIVE_UP_ALL),  # the run's only
    ({"max_restarts": 0, "max_restarts_per_rank": 0, "max_preemptions": 4}, EXIT_PREEMPTED, 4, Action.GIVE_UP),
    ({"policy": "gang", "max_restarts": 0, "max_preemptions": 2}, EXIT_PREEMPTED, 2, Action.GIVE_UP),
    ({"max_preemptions": 0}, EXIT_PREEMPTED, 0, Action.GIVE_UP),
])
def test_each_budget_pays_for_exactly_its_relaunches(table, exit_code, relaunches, last):
    assert relaunches_until_spent(settings(**table), exit_code) == (relaunches, last)


# -- min_replicas: where the run stands after a pass -----------------------------------------

@pytest.mark.parametrize("min_replicas, live, succeeded, waiting, given_up, alone, state", [
    (3, 3, 0, 0, 0, False, RunState.HEALTHY),
    (3, 2, 1, 0, 0, False, RunState.HEALTHY),     # one done, the others training
    (3, 3, 0, 1, 0, False, RunState.UNHEALTHY),   # waits for a relaunch
    (3, 3, 0, 3, 0, False, RunState.UNHEALTHY),   # a rank waiting for its relaunch counts as alive
    (2, 2, 0, 0, 1, False, RunState.UNHEALTHY),   # goes on with fewer
    (2, 1, 1, 0, 1, False, RunState.UNHEALTHY),   # exactly min_replicas alive or done
    (3, 3, 0, 0, 0, True, RunState.UNHEALTHY),    # the replicas train without meeting
    (3, 2, 0, 0, 1, False, RunState.FAILED),      # the default min_replicas is every rank
    (2, 1, 0, 0, 2, False, RunState.FAILED),
    (3, 0, 3, 0, 0, False, RunState.SUCCEEDED),
    (2, 0, 2, 0, 1, False, RunState.SUCCEEDED),   # with fewer, enough
    (2, 0, 2, 0, 1, True, RunState.SUCCEEDED),    # training alone is no failure once it is over
    (2, 0, 1, 0, 2, False, RunState.FAILED),      # over, too few succeeded
    (1, 0, 0, 0, 3, False, RunState.FAILED),
])
def test_min_replicas_outcome(min_replicas, live, succeeded, waiting, given_up, alone, state):
    o = outcome(min_replicas, n_replicas=3, live=live, succeeded=succeeded, waiting=waiting, given_up=given_up,
                alone=alone)
    assert o.state is state
    assert bool(o.reason) == (state is RunState.FAILED)


def test_a_failed_outcome_says_how_many_remain():
    o = outcome(2, n_replicas=3, live=1, succeeded=0, waiting=0, given_up=2, alone=False)
    assert o.reason == "only 1 of 3 replicas are alive or done, below min_replicas=2"


@pytest.mark.parametrize("state, final", [(s, s.value in ("SUCCEEDED", "FAILED", "STOPPED")) for s in RunState])
def test_only_succeeded_failed_and_stopped_are_final(state, final):
    assert state.is_final is final
