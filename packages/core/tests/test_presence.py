"""The presence markers (`diloco.store.presence`): what a listing of ``roster/`` says about who is
there, as a table; nothing that does not parse is read."""

from __future__ import annotations

import pytest

from diloco.store.presence import (RERUNS, away_name, incarnation, join_name, last_incarnation, read_presence,
                             rerun_ended)


@pytest.mark.parametrize("names, rank, away, joined, announced", [
    ([], 1, False, False, ()),
    ([away_name(1, 0)], 1, True, False, ()),                                  # its attempt ended
    ([away_name(1, 0), join_name(1, 7, 1)], 1, False, True, (7,)),            # a later attempt announced
    ([join_name(1, 7, 1), away_name(1, 1)], 1, True, False, ()),              # ... and that one ended too
    ([join_name(1, 7, 0), away_name(1, 0)], 1, True, False, ()),              # announced, then ended
    ([join_name(1, 7, 2), join_name(1, 9, 2)], 1, False, True, (7, 9)),       # one attempt, two rounds
    ([join_name(1, 7, 2), join_name(1, 9, 1)], 1, False, True, (7,)),         # an older attempt's words are old
    ([join_name(2, 7, 0)], 1, False, False, ()),                              # another rank's
    (["join-1", "join-1.7", "join-x.7.0", "join-1.7.0.0", "away-1", "away-1.x", "scale-00000001.json",
      "join--1.7.0", "join-1.99999999999999.0"], 1, False, False, ()),         # not markers: ignored
])
def test_what_the_markers_say(names, rank, away, joined, announced):
    p = read_presence(names)
    assert p.is_away(rank) is away
    assert (rank in p.joined()) is joined
    for r in range(12):
        assert p.announced(rank, r) is (r in announced)


A0, A0R1, A0R2, A1 = incarnation(0), incarnation(0, 1), incarnation(0, 2), incarnation(1)


@pytest.mark.parametrize("names, away", [
    ([away_name(1, A0), join_name(1, 7, A0R1)], False),                   # requeued: its next run announced
    ([away_name(1, A0R1), join_name(1, 7, A0R1)], True),                  # ... and that run was requeued too
    ([join_name(1, 7, A0R2), away_name(1, A0R1)], False),                 # a run after the one that ended
    ([away_name(1, last_incarnation(0)), join_name(1, 7, A0R2)], True),   # the attempt ended: all its runs
    ([away_name(1, last_incarnation(0)), join_name(1, 7, A1)], False),    # the relaunch outranks them all
    ([away_name(1, A0R1), join_name(1, 7, A1)], False),
])
def test_runs_of_one_attempt_are_told_apart(names, away):
    assert read_presence(names).is_away(1) is away


def test_incarnations_order_runs_within_attempts():
    order = [incarnation(a, k) for a in range(3) for k in (0, 1, 2, RERUNS - 2)] + [last_incarnation(2)]
    assert order == sorted(order) and len(set(order)) == len(order)
    assert last_incarnation(0) < incarnation(1) and incarnation(0, RERUNS + 5) == last_incarnation(0)
    assert rerun_ended(0, 3) == incarnation(0, 3) and rerun_ended(2, RERUNS - 2) == incarnation(2, RERUNS - 2)
    assert rerun_ended(2, RERUNS - 1) is None  # the next run would share its number: it could not outrank it


def test_a_rank_waiting_for_a_later_round():
    p = read_presence([join_name(3, 9, 1)])
    assert p.waits_for_later(3, 8) and not p.waits_for_later(3, 9) and not p.waits_for_later(3, 10)
    p = read_presence([join_name(3, 9, 1), join_name(3, 8, 1)])   # announced 8 after all (nobody else trained)
    assert not p.waits_for_later(3, 8)
    assert not read_presence([join_name(3, 9, 1), away_name(3, 1)]).waits_for_later(3, 8)  # it ended


def test_the_supervisor_marks_an_ended_attempt_away_in_the_store(tmp_path):
    """What the replicas read: an away marker for attempt 0 of rank 1 once the launcher sees it
    fail (and a relaunch is scheduled), none for a rank pending again under the same attempt (a
    platform retrying it), and one per rank given up; a store that cannot be written is an event,
    never the launcher's end."""
    from test_lifecycle import Scripted

    from diloco.protocol import ReplicaStatus
    from diloco.request import LaunchRequest
    from diloco.runrecord.state import RunRecord
    from diloco.store.objectstore import open_store
    from diloco.supervise.supervisor import Supervisor

    uri = f"file://{tmp_path / 'store'}"
    now = [1000.0]
    ex = Scripted()
    record = RunRecord.create("presence", {})
    request = LaunchRequest(run_id="presence", n_replicas=3, entrypoint="x:y", timeout=60, rendezvous=uri)
    sup = Supervisor(ex, record, request, {"backoff": 0, "policy": "per-rank"}, clock=lambda: now[0])
    sup.start()
    sup.tick()
    ex.now[(1, 0)] = (ReplicaStatus.FAILED, 1, "killed by SIGKILL")
    ex.now[(2, 0)] = ReplicaStatus.PENDING
    sup.tick()
    names = sorted(m["path"].rsplit("/", 1)[-1] for m in open_store(uri).list("presence/roster/"))
    assert names == [away_name(1, last_incarnation(0))]
    assert read_presence(names).is_away(1) and not read_presence(names).is_away(2)

    bad = RunRecord.create("presence-bad", {})
    (tmp_path / "not-a-dir").write_text("a file where the store should be")
    request = LaunchRequest(run_id="presence-bad", n_replicas=2, entrypoint="x:y", timeout=60,
                            rendezvous=f"file://{tmp_path / 'not-a-dir'}")
    ex = Scripted()
    sup = Supervisor(ex, bad, request, {"backoff": 0}, clock=lambda: now[0])
    sup.start()
    sup.tick()
    ex.now[(0, 0)] = (ReplicaStatus.FAILED, 1, "killed by SIGKILL")
    sup.tick()
    assert [e["rank"] for e in bad.events() if e["event"] == "presence_failed"] == [0]


def test_a_requeued_run_is_marked_away_when_the_platform_numbers_its_runs(tmp_path):
    """Slurm's requeue: the same job (attempt) pending again, Restarts one higher. An executor that
    numbers its re-runs (`numbered_reruns`) has the run that ended marked away at once, so its
    shards are taken over and no round waits for it; the next run (DILOCO_RERUN = 1) announces
    itself one higher and is there again. Unnumbered, nothing is marked (a grace window instead)."""
    from dataclasses import replace

    from test_lifecycle import Scripted

    from diloco.protocol import ReplicaStatus
    from diloco.request import LaunchRequest
    from diloco.runrecord.state import RunRecord
    from diloco.store.objectstore import open_store
    from diloco.supervise.supervisor import Supervisor

    class Requeuing(Scripted):
        capabilities = replace(Scripted.capabilities, numbered_reruns=True)

        def __init__(self):
            super().__init__()
            self.restarts: dict[tuple[int, int], int] = {}

        def reruns(self, handle):
            return self.restarts.get((handle.rank, handle.attempt), 0)

    for executor, marked in ((Requeuing(), [away_name(2, incarnation(0, 0))]), (Scripted(), [])):
        uri = f"file://{tmp_path / type(executor).__name__}"
        run = f"requeue-{type(executor).__name__.lower()}"
        request = LaunchRequest(run_id=run, n_replicas=3, entrypoint="x:y", timeout=60, rendezvous=uri)
        record = RunRecord.create(run, {})
        sup = Supervisor(executor, record, request, {"backoff": 0}, clock=lambda: 1000.0)
        sup.start()
        sup.tick()
        executor.now[(2, 0)] = ReplicaStatus.PENDING  # requeued by Slurm
        if isinstance(executor, Requeuing):
            executor.restarts[(2, 0)] = 1
        sup.tick()
        names = sorted(m["path"].rsplit("/", 1)[-1] for m in open_store(uri).list(f"{run}/roster/"))
        assert names == marked
        presence = read_presence([*names, join_name(2, 5, incarnation(0, 1))])  # the next run announces itself
        assert not presence.is_away(2) and presence.announced(2, 5)
        pending = [e for e in record.events() if e["event"] == "pending"]
        assert [e["rank"] for e in pending] == [2] and pending[0].get("rerun") == (1 if marked else None)
