"""Each round's roster (`roster`): who comes and goes, as a table; and what a decider reads
from the store — the newest well-formed target and the join markers — trusting nothing."""

from __future__ import annotations

import uuid

import pytest

from diloco.store.scaling import roster_body
from diloco.store.objectstore import open_store
from diloco_replica.round.steps.roster import Rosters, Target, next_roster
from diloco.store.runkeys import RunKeys
from diloco_replica.round.storeaccess import CountingStore


@pytest.mark.parametrize("current, target, joined, want", [
    ([0, 1], None, set(), [0, 1]),                              # never scaled
    ([0, 1], Target(1, (0, 1, 2, 3)), set(), [0, 1]),           # new ranks not ready: no round waits for them
    ([0, 1], Target(1, (0, 1, 2, 3)), {3}, [0, 1, 3]),          # each comes in once it has said so
    ([0, 1, 3], Target(1, (0, 1, 2, 3)), {2, 3}, [0, 1, 2, 3]),
    ([0, 1, 2, 3], Target(2, (0, 1)), {2, 3}, [0, 1]),          # shrink: at once, joined or not
    ([0, 1], Target(3, (4, 5)), set(), [0, 1]),                 # it would leave nobody: the roster stays
    ([0, 1], Target(3, (4, 5)), {4}, [4]),                      # all swapped for a new one that is ready
    ([0, 2], Target(1, (0, 1, 2)), {1, 7}, [0, 1, 2]),          # a join marker the target lacks is ignored
])
def test_the_next_rounds_roster(current, target, joined, want):
    assert next_roster(current, target, joined) == want


def test_a_decider_reads_the_newest_wellformed_target_and_the_join_markers():
    store, run = open_store(f"memory://{uuid.uuid4().hex}"), "run-roster"
    keys, logged = RunKeys(run), []
    rosters = Rosters(CountingStore(store), keys, run, logged.append)
    assert rosters.look()[0] is None and rosters.look()[1].joined() == set()
    store.put(keys.scale(1), roster_body(run, 1, [0, 1, 2]))
    store.put(keys.scale(2), b"{not json")                      # newer, but malformed: ignored, logged once
    store.put(keys.scale(3), roster_body("another-run", 3, [0]))
    rosters.announce(2, 5, 0)
    rosters.announce(2, 5, 0)                                   # the same words again: as good
    store.put(f"{keys.roster()}join-x", b"{}")
    store.put(f"{keys.roster()}join-3", b"{}")                  # not rank.round.attempt: ignored
    target, presence = rosters.look()
    assert target == Target(1, (0, 1, 2)) and presence.joined() == {2} and presence.announced(2, 5)
    assert rosters.look()[0] == Target(1, (0, 1, 2)) and len(logged) == 2
    store.put(keys.scale(4), roster_body(run, 4, [0, 1]))
    assert rosters.look()[0] == Target(4, (0, 1))


@pytest.mark.parametrize("meta, problem", [
    ({"members": [0, 1], "lanes": [1, 2]}, "next must be"),                        # no next round's roster
    ({"members": [0, 1], "lanes": [1, 2], "next": []}, "next must be"),
    ({"members": [0, 1], "lanes": [1, 2], "next": [2, 1]}, "next must be"),
    ({"members": [0, 1], "lanes": [1, 2], "next": [0, True]}, "next must be"),
    ({"members": [1, 0], "lanes": [1, 2], "next": [0, 1]}, "members must be"),
    ({"members": [0, 1], "lanes": [1], "next": [0, 1]}, "a lane count"),
    ({"members": [0, 1], "lanes": [1, 0], "next": [0, 1]}, "a lane count"),
    ({"members": [0, 1], "lanes": [1, 5000], "next": [0, 1]}, "a lane count"),
    ({"members": [0, 1], "lanes": [1, 2], "next": [0, 1]}, "an incarnation per member"),              # none
    ({"members": [0, 1], "lanes": [1, 2], "next": [0, 1], "incarnations": [0]}, "an incarnation per member"),
    ({"members": [0, 1], "lanes": [1, 2], "next": [0, 1], "incarnations": [0, -1]}, "an incarnation per member"),
    ({"members": [0, 1], "lanes": [1, 2], "next": [0, 1], "incarnations": [0, "1"]}, "an incarnation per member"),
])
def test_a_malformed_membership_record_is_corrupt_not_a_crash(meta, problem):
    from diloco_replica.round.allreduce import StoreAllReduce
    from diloco_replica.transport.wire import CorruptObject, Identity, pack_json

    store, run = open_store(f"memory://{uuid.uuid4().hex}"), "run-members"
    store.put(RunKeys(run).members(3), pack_json(Identity(run, 3, "members"), meta))
    ar = StoreAllReduce(store, run, 0, 2)
    try:
        with pytest.raises(CorruptObject, match=problem):
            ar.membership.read(3)
        store.put(RunKeys(run).members(4), pack_json(Identity(run, 4, "members"),
                                                    {"members": [0, 1], "lanes": [1, 2], "next": [0, 1, 5],
                                                     "incarnations": [0, 3]}))
        assert ar.membership.read(4).layouts == {0: 1, 1: 2} and ar.roster(5) == [0, 1, 5]
        assert ar.membership.read(4).incarnations_of == {0: 0, 1: 3}
    finally:
        ar.close()


@pytest.mark.parametrize("current, target, joined, min_members, want", [
    ([0, 1, 2], Target(2, (2, 3)), set(), 2, [0, 1, 2]),     # [2] alone is below min_members: wait for 3
    ([0, 1, 2], Target(2, (2, 3)), {3}, 2, [2, 3]),          # 3 is in: the swap happens at once
    ([0, 1, 2], Target(2, (2,)), set(), 2, [2]),             # the target itself is smaller: it is what was asked
])
def test_a_roster_drops_below_min_members_only_when_the_target_itself_is_smaller(current, target, joined, min_members, want):
    assert next_roster(current, target, joined, min_members) == want
