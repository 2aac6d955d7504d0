"""Who a round waits for, and for how long (`quorum`): the rules as tables, then the decision
against a real (in-memory) store with ready, join and away markers."""

from __future__ import annotations

import time
import uuid

import pytest
import torch

from diloco.store.presence import away_name, join_name
from diloco.store.objectstore import open_store
from diloco_replica.round.steps.quorum import GRACE_FLOOR, Absent, Verdict, expected, grace_seconds, verdict


@pytest.mark.parametrize("roster, kw, want", [
    # the run's first round: everyone the launcher has not seen end
    ([0, 1, 2], dict(first=True, last_members=[], last_roster=[], announced=set(), away=set()), {0, 1, 2}),
    ([0, 1, 2], dict(first=True, last_members=[], last_roster=[], announced=set(), away={2}), {0, 1}),
    # later: the last round's members
    ([0, 1, 2], dict(first=False, last_members=[0, 1, 2], last_roster=[0, 1, 2], announced=set(), away=set()),
     {0, 1, 2}),
    # one that missed the last round does not hold this one ...
    ([0, 1, 2], dict(first=False, last_members=[0, 1], last_roster=[0, 1, 2], announced=set(), away=set()), {0, 1}),
    # ... until a live attempt of it announces this round
    ([0, 1, 2], dict(first=False, last_members=[0, 1], last_roster=[0, 1, 2], announced={2}, away=set()),
     {0, 1, 2}),
    # a member of the last round the launcher saw end since
    ([0, 1, 2], dict(first=False, last_members=[0, 1, 2], last_roster=[0, 1, 2], announced=set(), away={1}), {0, 2}),
    # one that announced a later round only (rejoining: training nothing now)
    ([0, 1, 2], dict(first=False, last_members=[0, 1, 2], last_roster=[0, 1, 2], announced=set(), away=set(),
                     later={2}), {0, 1}),
    # a rank this roster lets in for the first time (`diloco scale`) is expected
    ([0, 1, 3], dict(first=False, last_members=[0, 1], last_roster=[0, 1], announced=set(), away=set()), {0, 1, 3}),
    # a rank the roster dropped is not, member or not
    ([0, 1], dict(first=False, last_members=[0, 1, 2], last_roster=[0, 1, 2], announced={2}, away=set()), {0, 1}),
])
def test_who_a_round_expects(roster, kw, want):
    assert expected(roster, **kw) == want


@pytest.mark.parametrize("periods, setting, timeout, want", [
    ([], None, 300.0, GRACE_FLOOR),                 # no history: the floor
    ([2.0, 2.1, 1.9], None, 300.0, GRACE_FLOOR),    # fast rounds: never under the floor
    ([30.0, 32.0, 31.0], None, 300.0, 31.0),        # one recent period (the median)
    ([30.0, 300.0, 31.0, 29.0, 30.0], None, 300.0, 30.0),  # one slow round does not move it
    ([1.0, 1.0, 1.0, 1.0, 1.0, 40, 40, 40, 40, 40], None, 300.0, 40.0),  # only the last five count
    ([500.0], None, 300.0, 300.0),                  # never past round_timeout
    ([30.0], 2.0, 300.0, 2.0),                      # round_grace sets it outright
    ([30.0], 0.0, 300.0, 0.0),
    ([30.0], 900.0, 60.0, 60.0),
])
def test_the_grace_window(periods, setting, timeout, want):
    assert grace_seconds(periods, round_timeout=timeout, setting=setting) == pytest.approx(want)


R = [0, 1, 2, 3]


@pytest.mark.parametrize("ready, expect, waited, grace, min_members, want", [
    ({0, 1, 2, 3}, {0, 1, 2, 3}, 0.0, 5.0, 1, Verdict.CLOSE),     # everyone: at once
    ({0, 1, 2}, {0, 1, 2}, 0.0, 5.0, 1, Verdict.CLOSE),           # everyone expected: at once, 3 is gone
    ({0, 1}, {0, 1, 2}, 1.0, 5.0, 1, Verdict.WAIT),               # an expected one is missing: the window
    ({0, 1}, {0, 1, 2}, 5.0, 5.0, 1, Verdict.CLOSE),              # ... then without it
    ({0}, {0, 1, 2}, 5.0, 5.0, 2, Verdict.WAIT),                  # below min_members: on to round_timeout
    ({0}, {0}, 0.0, 5.0, 2, Verdict.WAIT),                        # even with everyone expected there
    ({0}, {0, 1, 2}, 60.0, 5.0, 2, Verdict.FAIL),                 # round_timeout below min_members: fails
    ({0, 1}, {0, 1, 2}, 60.0, 90.0, 2, Verdict.CLOSE),            # round_timeout with enough: closes
    ({0, 1, 2, 3}, set(), 0.0, 5.0, 1, Verdict.CLOSE),
])
def test_when_a_round_closes(ready, expect, waited, grace, min_members, want):
    assert verdict(ready, R, expect, waited=waited, grace=grace, round_timeout=60.0, min_members=min_members) is want


def test_why_each_absent_rank_is_absent():
    got = Absent.of([0, 1, 2, 3, 4], {0}, expected_ranks={0, 1}, away={2}, later={3})
    assert [(a.rank, a.why) for a in got] == [(1, "late"), (2, "away"), (3, "rejoining"), (4, "missed")]


def _allreduce(store, run, rank, n, **kw):
    from diloco_replica.round.allreduce import StoreAllReduce

    return StoreAllReduce(store, run, rank, n, poll_interval=0.01, poll_max=0.05, **kw)


def test_a_round_does_not_wait_for_a_replica_that_missed_the_last_one():
    """Round 2 of 3 replicas whose rank 2 missed round 1: ranks 0 and 1 close it as soon as both
    are ready, though round_timeout is 60 s; the record says why rank 2 is not in it."""
    store, run = open_store(f"memory://{uuid.uuid4().hex}"), "run-quorum"
    a = _allreduce(store, run, 0, 3, round_timeout=60.0)
    keys = a.io.keys
    for k in (0, 1):
        store.put(keys.ready(1, k, 1), b"{}")
    store.put(keys.members(1), _record(run, 1, [0, 1], [0, 1, 2]))
    store.put(keys.ready(2, 1, 1), b"{}")
    store.put(keys.ready(2, 0, 1), b"{}")
    t0 = time.monotonic()
    decided = a.membership.decide(2, [0, 1, 2], [0, 1, 2])
    assert decided.members == [0, 1] and time.monotonic() - t0 < 2.0
    meta = _meta(store, keys.members(2))
    assert meta["absent"] == {"2": "missed"}


def test_a_member_the_launcher_saw_end_is_not_waited_for_and_one_announced_is():
    store, run = open_store(f"memory://{uuid.uuid4().hex}"), "run-quorum-away"
    a = _allreduce(store, run, 0, 3, round_timeout=60.0, round_grace=30.0)
    keys = a.io.keys
    store.put(keys.members(1), _record(run, 1, [0, 1, 2], [0, 1, 2]))
    store.put(keys.members(2), _record(run, 2, [0, 1], [0, 1, 2]))
    store.put(f"{keys.roster()}{away_name(1, 0)}", b"")          # rank 1's attempt 0 ended
    for k in (0, 2):
        store.put(keys.ready(2 + 1, k, 1), b"{}")
    store.put(keys.ready(2, 0, 1), b"{}")
    t0 = time.monotonic()
    # round 3: 0 and 1 were members of 2, 1 is away; 2 missed round 2 and has not announced
    assert a.membership.decide(3, [0, 1, 2], [0, 1, 2]).members == [0, 2]
    assert _meta(store, keys.members(3))["absent"] == {"1": "away"}
    # round 4: rank 1, re-run once (incarnation 1), announced round 4: it is waited for (the grace window, 30 s),
    # and closes the round the moment it is ready
    store.put(f"{keys.roster()}{join_name(1, 4, 1)}", b"")
    store.put(keys.ready(4, 0, 1), b"{}")
    store.put(keys.ready(4, 2, 1), b"{}")
    import threading

    threading.Timer(1.0, lambda: store.put(keys.ready(4, 1, 1), b"{}")).start()
    assert a.membership.decide(4, [0, 1, 2], [0, 1, 2]).members == [0, 1, 2]
    assert 0.9 < time.monotonic() - t0 < 10.0


def test_an_expected_replica_that_never_comes_costs_one_grace_window_not_round_timeout():
    store, run = open_store(f"memory://{uuid.uuid4().hex}"), "run-quorum-grace"
    a = _allreduce(store, run, 0, 2, round_timeout=60.0, round_grace=1.0)
    keys = a.io.keys
    store.put(keys.members(1), _record(run, 1, [0, 1], [0, 1]))
    store.put(keys.ready(2, 0, 1), b"{}")
    t0 = time.monotonic()
    assert a.membership.decide(2, [0, 1], [0, 1]).members == [0]
    assert 1.0 <= time.monotonic() - t0 < 5.0
    assert _meta(store, keys.members(2))["absent"] == {"1": "late"}


def _record(run, r, members, nxt):
    from diloco_replica.transport.wire import Identity, pack_json

    return pack_json(Identity(run, r, "members"), {"members": members, "lanes": [1] * len(members), "next": nxt,
                                                    "incarnations": [0] * len(members)})


def _meta(store, key):
    from diloco_replica.transport.wire import Identity, unpack

    run, r = key.split("/")[0], int(key.split("/")[1][1:])
    return unpack(store.get(key), Identity(run, r, "members"), key).meta


def _train_linear(store, run: str, rank: int, *, total_steps: int, round_timeout: float, attempt: int = 0,
                  log=None, before_step=None):
    """One replica of a 2-replica run of a tiny linear model, in this process, to its end: the
    same θ_0 everywhere, each rank's own data. `log` replaces its exchanger's log; `before_step(step)`
    runs before each inner step. Returns the closed `DiLoCo`."""
    from diloco.bootstrap.context import ReplicaContext
    from diloco_replica import DiLoCo

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    diloco = DiLoCo(model, opt, ReplicaContext(rank, 2, run, attempt=attempt), store=store, sync_every=2,
                    total_steps=total_steps, round_timeout=round_timeout, poll_max=0.05)
    if log is not None:
        diloco.sync.exchanger.log = log
    for step in diloco.steps():
        if before_step is not None:
            before_step(step)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * rank + step))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        diloco.step()
    diloco.close()
    return diloco


def test_a_reducer_whose_attempt_ended_is_taken_over_at_once_not_after_round_timeout():
    """Replica 1 is a member of the round and dies before reducing its shard; the launcher marks
    its attempt away (as the supervisor does when it sees the process end). The others take its
    shard over within seconds, though round_timeout is 30 s, and end the round on the same bytes."""
    from test_parts import deltas, run

    from diloco_replica.round.steps import reduce as reduce_module

    original = reduce_module.ShardReducer.reduce

    def hook(i, ar):
        if i != 1:
            return

        def reduce(self, rnd, j, *, takeover):
            if not takeover:
                ar.store.store.put(f"{ar.io.keys.roster()}{away_name(1, 0)}", b"")  # the launcher's word
                raise SystemExit("replica 1 died mid-round")
            return original(self, rnd, j, takeover=takeover)

        ar.reducer.reduce = reduce.__get__(ar.reducer)

    ds = deltas(3)
    t0 = time.monotonic()
    means, results, errors = run(3, ds, part_mb=64.0, hook=hook, timeout=30.0)
    assert time.monotonic() - t0 < 10.0
    assert set(errors) == {1}, errors
    assert torch.equal(means[0], means[2])
    assert sorted(results[0].takeovers + results[2].takeovers) == [1]


def test_a_straggler_whose_catch_up_meets_a_collected_round_rejoins_instead_of_dying(monkeypatch):
    """Found by the soak (2026-11-30): a replica left out of a round it was late for catches up
    by replaying the rounds decided since; when the run went past the store's retained history
    meanwhile (the replica was paused while the others checkpointed and collected), the replay
    meets a collected round (`FellBehind`). The replica is healthy: it rejoins from the newest
    checkpoint and ends on the others' model. It used to die with that error and cost a
    relaunch. The collection under the replay is the replay's first FellBehind here (the race
    needs a paused process and the collection in the same instant: tests/test_soak.py meets it)."""
    from diloco_replica import FellBehind
    from diloco_replica.outer.globalstate import GlobalState

    replay = GlobalState.catch_up
    collected_under: list[int] = []

    def catch_up(self, *, during: str = "catch-up") -> int:
        if self.ar.rank == 1 and during == "catch-up" and not collected_under:
            collected_under.append(self.round)
            raise FellBehind(f"round {self.round + 1} is at or below the store's retained history")
        return replay(self, during=during)

    monkeypatch.setattr(GlobalState, "catch_up", catch_up)
    store, run = open_store(f"memory://{uuid.uuid4().hex}"), "run-collected-under-a-straggler"
    finals: dict[int, bytes] = {}
    errors: list[tuple[int, BaseException]] = []
    logs: list[str] = []

    def replica(rank: int) -> None:
        def late_for_round_2(step: int) -> None:
            if rank == 1 and step == 3:
                time.sleep(2.5)  # late for round 2: the other closes it alone after round_timeout

        try:
            diloco = _train_linear(store, run, rank, total_steps=12, round_timeout=1.0,
                                   log=logs.append if rank == 1 else None, before_step=late_for_round_2)
            finals[rank] = diloco.theta.numpy().tobytes()
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append((rank, exc))

    import threading

    threads = [threading.Thread(target=replica, args=(k,)) for k in (0, 1)]
    [t.start() for t in threads]
    [t.join(timeout=120) for t in threads]
    assert not errors, errors
    assert collected_under == [2], collected_under  # left out of round 2, its replay from there met the collection
    assert any("rejoining from the latest checkpoint" in line for line in logs), logs
    assert finals[0] == finals[1]


def test_a_non_member_row_never_replaces_the_member_row_of_its_round():
    """Found by the soak: a replica that was a member of round 10, then fell behind and rejoined
    from checkpoint 10, wrote its non-member row of round 10 over its member row, and the round's
    record lost that member's work. A non-member's row goes in only where none is."""
    from diloco.store.metrics import RoundMetrics
    from diloco_replica.records.recorder import Recorder

    store, run = open_store(f"memory://{uuid.uuid4().hex}"), "run-rows"
    ar = _allreduce(store, run, 1, 2, round_timeout=1.0)
    recorder = Recorder(ar, log=lambda _: None)
    key = ar.io.keys.metrics(10, 1)
    recorder.write_row(RoundMetrics(round=10, rank=1, attempt=0, members=[0, 1], member=True, loss=2.5))
    recorder.write_row(RoundMetrics(round=10, rank=1, attempt=1, members=[0, 1], member=False))
    assert RoundMetrics.from_json(bytes(store.get(key))).member
    recorder.write_row(RoundMetrics(round=11, rank=1, attempt=1, members=[0], member=False))  # none there: it goes in
    assert not RoundMetrics.from_json(bytes(store.get(ar.io.keys.metrics(11, 1)))).member
    ar.close()


def test_a_round_whose_members_all_died_before_their_rows_is_recorded_by_the_replica_that_rejoins_from_it():
    """Rows are written in the background after a round is applied, so members that all die in
    that instant leave their round with no row although the run goes on from its state (the
    soak's record check meets it). A replica that starts from a round it took no part in writes
    that round's row as a non-member: the round's members, the state's digest; never for round 0,
    and never over a member's row of that round (create-only)."""
    from diloco.store.metrics import RoundMetrics
    from diloco.store.runkeys import RunKeys

    store, run = open_store(f"memory://{uuid.uuid4().hex}"), "run-rows-of-the-dead"
    keys = RunKeys(run)

    def train(rank: int, attempt: int = 0) -> None:
        _train_linear(store, run, rank, attempt=attempt, total_steps=4, round_timeout=5.0)

    import threading

    threads = [threading.Thread(target=train, args=(k,)) for k in (0, 1)]
    [t.start() for t in threads]
    [t.join(timeout=120) for t in threads]

    def row(r: int, rank: int) -> RoundMetrics | None:
        raw = store.get(keys.metrics(r, rank))
        return RoundMetrics.from_json(bytes(raw)) if raw is not None else None

    first = {rank: row(2, rank) for rank in (0, 1)}
    assert all(first[k] is not None and first[k].member for k in (0, 1))
    assert store.get(keys.metrics(0, 0)) is None and store.get(keys.metrics(0, 1)) is None
    store.delete(keys.metrics(2, 1))  # rank 1 died before its row of round 2 went in; rank 0's stays

    for rank in (0, 1):
        train(rank, attempt=1)  # relaunched: joins from round 2's state (the run is over: it trains no more)
    kept, written = row(2, 0), row(2, 1)
    assert kept is not None and kept.member and kept.attempt == 0  # a member's row is never replaced
    assert written is not None and not written.member and written.attempt == 1
    assert written.members == [0, 1] and written.step == 4
    assert written.state_digest == first[1].state_digest  # the state it holds is the round's
    assert store.get(keys.metrics(0, 1)) is None
