"""The presence markers (`diloco.presence`): what a listing of ``roster/`` says about who is
there, as a table; nothing that does not parse is read."""

from __future__ import annotations

import pytest

from diloco.presence import away_name, join_name, read_presence


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
    from diloco.state import RunRecord
    from diloco.store import open_store
    from diloco.supervisor import Supervisor

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
    assert names == [away_name(1, 0)]
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
