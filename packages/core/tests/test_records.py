"""Every record diloco keeps goes through one mechanism (diloco.records): it round-trips, and a
document read back is decoded field by field, a bad field named in one ValueError."""

from __future__ import annotations

import json

import pytest

from diloco.spec.groups import ReplicaGroup
from diloco.store.metrics import RoundMetrics, RoundSummary
from diloco.protocol import ReplicaHandle, ReplicaResult, ReplicaStatus
from diloco.runrecord.rankstate import RankState, RankStatus
from diloco.records import RecordError, from_record, to_record
from diloco.runrecord.rundoc import LauncherBeat

HANDLE = ReplicaHandle(2, "eks", {"job": "r-2", "attempt": 1, "run_id": "r"})
ROW = RoundMetrics(round=3, rank=1, members=[0, 1], loss=None, requests={"put": 2}, incidents=[{"object": "x"}],
                   evals=[[100.0, 2.5]], phases={"wait": 0.5})


@pytest.mark.parametrize("record", [
    HANDLE,
    ReplicaResult(2, ReplicaStatus.FAILED, 3, "boom", {"loss": 1.5}, 1),
    RankState(2, HANDLE, RankStatus.CANCELLED_BY_SUPERVISOR, restarts=1, attempts=[HANDLE.to_dict()], group="g0"),
    LauncherBeat(pid=12, host="h", heartbeat=3.5, started=1.25),
    ReplicaGroup(name="g0", replicas=2, backend="local", backend_options={"grace_period": 1.0}, first_rank=0,
                 timeout=60.0),
    ROW,
    RoundSummary.from_rows(3, [ROW]),
], ids=lambda r: type(r).__name__)
def test_every_record_round_trips_through_json(record):
    data = json.loads(json.dumps(to_record(record)))
    assert from_record(type(record), data) == record


@pytest.mark.parametrize("cls, data, named", [
    (ReplicaHandle, {"rank": "2", "backend_name": "eks"}, "a.rank is not a valid int: '2'"),
    (ReplicaHandle, {"rank": 2}, "a.backend_name is missing"),
    (ReplicaHandle, {"rank": 2, "backend_name": "eks", "metadata": ["x"]}, "a.metadata is not an object"),
    (ReplicaHandle, ["not", "an", "object"], "a must be a JSON object"),
    (RankState, {"rank": 1, "status": "exploded"}, "a.status is not one of pending, running"),
    (RankState, {"rank": 1, "handle": {"rank": True, "backend_name": "x"}}, "a.handle.rank is not a valid int"),
    (RankState, {"rank": 1, "attempts": [{"a": 1}, 7]}, "a.attempts[1] is not an object"),
    (RoundMetrics, {"round": 1, "rank": 0, "loss": "nan"}, "a.loss is not a valid float"),
    (RoundMetrics, {"round": 1, "rank": 0, "evals": [[1.0, float("inf")]]}, "a.evals[0][1] is not a valid float"),
    (RoundSummary, {"round": 1, "members": [0], "reported": [0], "loss": None, "tokens": 1, "tokens_per_s": None,
                    "sync_share": None, "bytes_up": 0, "bytes_down": 0, "rows": [{"round": 1}]},
     "a.rows[0].rank is missing"),
])
def test_a_bad_field_is_named_in_one_value_error(cls, data, named):
    with pytest.raises(RecordError) as err:
        from_record(cls, data, where="a")
    assert isinstance(err.value, ValueError) and named in str(err.value) and "\n" not in str(err.value)


def test_keys_a_record_does_not_declare_are_not_read():
    assert from_record(LauncherBeat, {"pid": 1, "planted": {"x": 1}}) == LauncherBeat(pid=1)
