"""The restart policy as tables of cases: no processes, no sleeps, no clock."""

from __future__ import annotations

import pytest

from diloco.errors import EXIT_CONFIG, EXIT_PREEMPTED, EXIT_TIME_LIMIT, SpecError
from diloco.bootstrap.failures import is_time_limit
from diloco.supervise.policy import (ALL_CANCELLED_WINDOW, Action, Decision, Ending, Failure, Peer, RestartSettings, RunState,
                           Spend, cancelled_everywhere, decide, outcome, spent_on_decision, spent_on_relaunch)

BUG = "ValueError: bad shape (at global step 120)"


def settings(**table) -> RestartSettings:
    return RestartSettings.from_table(table, n_replicas=3)


def failure(exit_code=1, error="killed by SIGKILL (exit code 137)", launched_at=100.0, now=110.0) -> Failure:
    return Failure(exit_code, error, launched_at, now)


TIMED_OUT = failure(EXIT_TIME_LIMIT, "Slurm job 12 reached its Slurm time limit (TIMEOUT; sbatch --time)")
CANCELLED = Failure(None, "Slurm job 12 was cancelled outside diloco by uid 1000", 100.0, 110.0, cancelled=True)


def ask(s: RestartSettings, f: Failure, *, restarts=0, restarts_used=0, preemptions_used=0, time_limits=0,
        peers=None) -> Decision:
    return decide(s, f, rank=1, restarts=restarts, restarts_used=restarts_used, preemptions_used=preemptions_used,
                  time_limits=time_limits, peers=peers if peers is not None else [Peer(None, False), Peer(None, False)])


def brief(d: Decision) -> tuple:
    return d.action, d.delay, d.preempted, d.reason


def test_defaults_come_from_the_spec_schema_once():
    s = settings()
    assert (s.policy, s.max_restarts, s.max_restarts_per_rank, s.backoff, s.backoff_max, s.min_replicas,
            s.max_preemptions, s.max_time_limits_per_rank, s.fail_fast_seconds) == \
        ("per-rank", 10, 3, 1.0, 60.0, 3, 50, 1000, 900.0)
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


@pytest.mark.parametrize("f, preempted", [(failure(), False), (failure(EXIT_PREEMPTED), True), (TIMED_OUT, False),
                                          (CANCELLED, False)], ids=["failed", "preempted", "time limit", "cancelled"])
def test_policy_never_gives_a_rank_up_at_its_first_ending_whatever_ended_it(f, preempted):
    """`policy = "never"`: no relaunch, not even for the lifecycle events that spend no budget."""
    assert brief(ask(settings(policy="never"), f)) == (Action.GIVE_UP, 0.0, preempted, "restart policy is never")


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
        Decision(Action.RELAUNCH, delay=2.0, ending=Ending.PREEMPTED)
    assert ask(s, failure(EXIT_PREEMPTED), preemptions_used=50) == \
        Decision(Action.GIVE_UP, ending=Ending.PREEMPTED, reason="max_preemptions (50) reached")
    assert ask(settings(policy="gang"), failure(EXIT_PREEMPTED), restarts_used=1) == \
        Decision(Action.GANG_RESTART, delay=2.0, ending=Ending.PREEMPTED)


# -- time limits: a lifecycle event with its own budget ----------------------------------------

@pytest.mark.parametrize("table, kwargs, expected", [
    # relaunched at once, whatever the failure budgets say
    ({"max_restarts": 0, "max_restarts_per_rank": 0, "backoff": 5}, {"restarts": 3, "restarts_used": 10},
     Decision(Action.RELAUNCH, ending=Ending.TIME_LIMIT)),
    ({"policy": "gang", "max_restarts": 0}, {"restarts_used": 4},
     Decision(Action.GANG_RESTART, ending=Ending.TIME_LIMIT)),
    ({"policy": "never"}, {}, Decision(Action.GIVE_UP, ending=Ending.TIME_LIMIT, reason="restart policy is never")),
    ({}, {"time_limits": 999}, Decision(Action.RELAUNCH, ending=Ending.TIME_LIMIT)),
    ({}, {"time_limits": 1000}, Decision(Action.GIVE_UP, ending=Ending.TIME_LIMIT,
                                         reason="max_time_limits_per_rank (1000) reached")),
    ({"max_time_limits_per_rank": 2}, {"time_limits": 2},
     Decision(Action.GIVE_UP, ending=Ending.TIME_LIMIT, reason="max_time_limits_per_rank (2) reached")),
    ({"max_time_limits_per_rank": 0}, {}, Decision(Action.GIVE_UP, ending=Ending.TIME_LIMIT,
                                                   reason="max_time_limits_per_rank (0) reached")),
    ({}, {"preemptions_used": 50}, Decision(Action.RELAUNCH, ending=Ending.TIME_LIMIT)),  # not a preemption's budget
])
def test_a_time_limit_spends_only_its_own_budget(table, kwargs, expected):
    assert ask(settings(**table), TIMED_OUT, **kwargs) == expected


@pytest.mark.parametrize("exit_code, error, timed_out", [
    (EXIT_TIME_LIMIT, "Slurm job 7 reached its Slurm time limit (TIMEOUT; sbatch --time)", True),
    (EXIT_TIME_LIMIT, "train-r0-a1 ran past the spec's timeout (MaxRuntimeInSeconds) (exit code 124)", True),
    (EXIT_TIME_LIMIT, None, True),  # a Modal TIMEOUT, a Job's DeadlineExceeded: the code alone says it
    # the runner's watchdog killed its own process group: SIGKILL's code, its last words say why
    (137, "time limit: replica timed out after 60s (spec `timeout`); killing the replica\nlast output:\n", True),
    (137, "killed by SIGKILL (exit code 137)\ntime limit: replica timed out after 60s", False),  # not its cause
    (1, "ValueError: time limit: too short (at global step 3)", False),
    (143, "killed by SIGTERM (exit code 143)", False),
])
def test_a_time_limit_is_read_from_the_exit_code_or_the_cause_line(exit_code, error, timed_out):
    assert is_time_limit(exit_code, error) is timed_out
    d = ask(settings(max_restarts_per_rank=0), failure(exit_code, error))
    assert (d.ending is Ending.TIME_LIMIT, d.action) == (timed_out, Action.RELAUNCH if timed_out else Action.GIVE_UP)


def test_a_time_limit_never_counts_toward_the_same_bug_everywhere():
    d = ask(settings(), failure(EXIT_TIME_LIMIT, "time limit: replica timed out after 60s (at global step 120)",
                                launched_at=100.0, now=101.0), peers=[Peer(BUG, True), Peer(BUG, True)])
    assert d.action is Action.RELAUNCH and (d.signature, d.failed_soon) == (None, False)


# -- cancelled outside diloco: that rank's loss, within the failure budgets ---------------------

@pytest.mark.parametrize("table, kwargs, action, reason", [
    ({}, {}, Action.RELAUNCH, ""),
    ({}, {"restarts": 3}, Action.GIVE_UP, "restart budget spent"),
    ({}, {"restarts_used": 10}, Action.GIVE_UP, "restart budget spent"),
    ({"policy": "never"}, {}, Action.GIVE_UP, "restart policy is never"),
    ({"policy": "gang"}, {}, Action.GANG_RESTART, ""),
    ({"policy": "gang"}, {"restarts_used": 10}, Action.GIVE_UP_ALL, "gang restart budget spent"),
    # every other rank failed soon with the same bug: a cancel is not that bug, the rank comes back
    ({}, {"peers": [Peer(BUG, True), Peer(BUG, True)]}, Action.RELAUNCH, ""),
])
def test_a_replica_cancelled_outside_diloco_is_relaunched_within_the_restart_budget(table, kwargs, action, reason):
    d = ask(settings(**table), CANCELLED, **kwargs)
    assert (d.action, d.ending, d.reason, d.signature, d.failed_soon) == \
        (action, Ending.CANCELLED_OUTSIDE, reason, None, False)


def test_a_cancel_from_outside_wins_over_what_its_exit_code_looks_like():
    for code in (EXIT_CONFIG, EXIT_PREEMPTED, EXIT_TIME_LIMIT):
        d = ask(settings(), Failure(code, "cancelled", 100.0, 110.0, cancelled=True))
        assert (d.action, d.ending) == (Action.RELAUNCH, Ending.CANCELLED_OUTSIDE)


W = ALL_CANCELLED_WINDOW


@pytest.mark.parametrize("cancelled_at, now, everywhere", [
    ([1000.0, 1000.0], 1000.0, True),              # both at once (scancel -u, a script)
    ([1000.0, 1000.0 + W], 1000.0 + W, True),       # one after the other, within the window
    ([1000.0, 1001.0 + W], 1001.0 + W, False),      # the first was back long before the second
    ([1000.0, None], 1000.0, False),                # one rank was never cancelled
    ([None, None], 1000.0, False),
    ([1000.0], 1000.0, True),                       # the only replica left
    ([], 1000.0, False),                            # nobody left in the run: not a cancel
])
def test_every_replica_cancelled_outside_within_the_window_stops_the_run(cancelled_at, now, everywhere):
    assert cancelled_everywhere(cancelled_at, now=now) is everywhere



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
    ({}, TIMED_OUT, {}, Action.RELAUNCH, Spend(time_limits=1)),
    ({"policy": "gang"}, TIMED_OUT, {}, Action.GANG_RESTART, Spend(time_limits=1)),  # not a restart of the run
    ({}, TIMED_OUT, {"time_limits": 1000}, Action.GIVE_UP, Spend()),
    ({}, CANCELLED, {}, Action.RELAUNCH, Spend()),  # a failure's price, paid when launched
    ({"policy": "gang"}, CANCELLED, {}, Action.GANG_RESTART, Spend(run_restarts=1)),
])
def test_what_a_decision_spends_at_once(table, f, kwargs, action, spent):
    d = ask(settings(**table), f, **kwargs)
    assert (d.action, spent_on_decision(d)) == (action, spent)


@pytest.mark.parametrize("policy, paid, spent", [
    ("per-rank", False, Spend(restarts=1, run_restarts=1)),
    ("per-rank", True, Spend()),            # paid from max_preemptions / max_time_limits_per_rank when decided
    ("gang", False, Spend(restarts=1)),     # the run's restart was paid once, when decided
    ("gang", True, Spend()),
])
def test_what_a_relaunch_spends_when_launched(policy, paid, spent):
    assert spent_on_relaunch(policy, paid=paid) == spent


@pytest.mark.parametrize("ending, paid", [(Ending.FAILED, False), (Ending.PREEMPTED, True),
                                          (Ending.TIME_LIMIT, True), (Ending.CANCELLED_OUTSIDE, False)])
def test_only_lifecycle_events_are_paid_when_decided(ending, paid):
    assert ending.paid_when_decided is paid


def relaunches_until_spent(s: RestartSettings, f: Failure) -> tuple[int, Action]:
    """One rank ending so on every attempt: how many relaunches its budgets pay for, and the last answer."""
    restarts = run_restarts = preemptions = time_limits = 0
    for n in range(2000):
        d = ask(s, f, restarts=restarts, restarts_used=run_restarts, preemptions_used=preemptions,
                time_limits=time_limits)
        if d.action not in (Action.RELAUNCH, Action.GANG_RESTART):
            return n, d.action
        for spent in (spent_on_decision(d), spent_on_relaunch(s.policy, paid=d.ending.paid_when_decided)):
            restarts, run_restarts = restarts + spent.restarts, run_restarts + spent.run_restarts
            preemptions, time_limits = preemptions + spent.preemptions, time_limits + spent.time_limits
    raise AssertionError("the budgets never ran out")


@pytest.mark.parametrize("table, f, relaunches, last", [
    ({}, failure(1), 3, Action.GIVE_UP),                                    # max_restarts_per_rank
    ({"max_restarts": 2}, failure(1), 2, Action.GIVE_UP),                   # the run's budget, first
    ({"max_restarts": 0}, failure(1), 0, Action.GIVE_UP),                   # none at all
    ({"policy": "gang", "max_restarts": 2}, failure(1), 2, Action.GIVE_UP_ALL),
    ({"policy": "gang", "max_restarts": 2, "max_restarts_per_rank": 0}, failure(1), 2, Action.GIVE_UP_ALL),  # the run's only
    ({"max_restarts": 0, "max_restarts_per_rank": 0, "max_preemptions": 4}, failure(EXIT_PREEMPTED), 4, Action.GIVE_UP),
    ({"policy": "gang", "max_restarts": 0, "max_preemptions": 2}, failure(EXIT_PREEMPTED), 2, Action.GIVE_UP),
    ({"max_preemptions": 0}, failure(EXIT_PREEMPTED), 0, Action.GIVE_UP),
    ({"max_restarts": 0, "max_restarts_per_rank": 0}, TIMED_OUT, 1000, Action.GIVE_UP),  # the generous default
    ({"max_time_limits_per_rank": 5, "max_preemptions": 0}, TIMED_OUT, 5, Action.GIVE_UP),
    ({"policy": "gang", "max_restarts": 0, "max_time_limits_per_rank": 3}, TIMED_OUT, 3, Action.GIVE_UP),
    ({"max_time_limits_per_rank": 0}, TIMED_OUT, 0, Action.GIVE_UP),
    ({}, CANCELLED, 3, Action.GIVE_UP),                                     # the failure budgets
    ({"max_restarts": 1}, CANCELLED, 1, Action.GIVE_UP),
])
def test_each_budget_pays_for_exactly_its_relaunches(table, f, relaunches, last):
    assert relaunches_until_spent(settings(**table), f) == (relaunches, last)


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
