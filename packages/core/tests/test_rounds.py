"""Round summaries: one metrics type, reads that cost O(new rounds), and what the launcher makes of them."""

from __future__ import annotations

import json
import uuid

from diloco.store.metrics import RoundMetrics, RoundReader, RoundSummary, divergence, read_rounds
from diloco.store.runkeys import RunKeys
from diloco.store.objectstore import open_store
from diloco.testing.counting import RequestCounter


def row(r: int, rank: int, members: list[int], digest: str = "aa-bb", **kw) -> RoundMetrics:
    return RoundMetrics(round=r, rank=rank, members=members, loss=1.0 / r, tokens=100, bytes_up=10, bytes_down=15,
                        compute_s=1.0, sync_s=0.1, state_digest=digest, **kw)


def write_round(store, run, r, rows, *, summary=True):
    for x in rows:
        store.put(RunKeys(run).metrics(r, x.rank), x.to_json())
    if summary:
        store.put(RunKeys(run).summary(r), RoundSummary.from_rows(r, rows).to_json())


def test_reading_progress_costs_new_rounds_not_all_rounds():
    store, run = open_store(f"memory://{uuid.uuid4().hex}"), "run-s"
    for r in range(1, 201):
        write_round(store, run, r, [row(r, k, [0, 1, 2, 3]) for k in range(4)])
    counting = RequestCounter(store)
    reader = RoundReader(counting, run)
    assert [s.round for s in reader.read_new()] == list(range(1, 201))
    assert counting.gets == 200  # one per round, not one per replica per round
    counting.gets = counting.lists = 0
    assert reader.read_new() == []
    assert counting.gets == 0 and counting.lists == 1  # nothing new: one LIST
    for r in (201, 202):
        write_round(store, run, r, [row(r, k, [0, 1, 2, 3]) for k in range(4)])
    assert [s.round for s in reader.read_new()] == [201, 202] and counting.gets == 2


def test_a_round_whose_recorder_died_is_rebuilt_from_its_rows():
    store, run = open_store(f"memory://{uuid.uuid4().hex}"), "run-o"
    write_round(store, run, 1, [row(1, k, [0, 1]) for k in range(2)])
    write_round(store, run, 2, [row(2, k, [0, 1]) for k in range(2)], summary=False)
    reader = RoundReader(store, run)
    assert [s.round for s in reader.read_new()] == [1]  # round 2 may still be being recorded
    assert [s.round for s in reader.read_new(final=True)] == [2]  # the run ended: rebuild it


def test_a_row_that_comes_after_its_round_was_rebuilt_is_read_once_so_its_incidents_count():
    store, run = open_store(f"memory://{uuid.uuid4().hex}"), "run-l"
    reset = {"round": 1, "writer": 2, "replica": 2, "problem": "non-finite update", "action": "rank 2 reset"}
    write_round(store, run, 1, [row(1, k, [0, 1, 2]) for k in range(2)], summary=False)  # rank 2 paused
    write_round(store, run, 2, [row(2, k, [0, 1]) for k in range(2)])
    reader = RoundReader(store, run)
    [one, two] = reader.read_new()
    assert (one.round, one.complete, two.complete) == (1, False, True)
    assert reader.late_rows() == []  # nothing late yet: one LIST of round 1's rows
    store.put(RunKeys(run).metrics(1, 2), row(1, 2, [0, 1, 2], incidents=[reset]).to_json())
    store.put(RunKeys(run).metrics(1, 9), b"not a row")  # what the store holds is not trusted
    [late] = reader.late_rows()
    assert (late.round, late.rank, late.incidents) == (1, 2, [reset])
    assert reader.late_rows() == []  # once; and round 1 is complete now, so no longer watched
    write_round(store, run, 3, [row(3, 0, [0, 1])])  # rank 1's row never comes: watched LATE_ROUNDS rounds
    assert [s.round for s in reader.read_new(final=True)] == [3] and reader.late_rows() == []


def test_divergence_names_the_minority_and_breaks_ties_by_rank():
    rows = [row(3, k, [0, 1, 2, 3], digest="good") for k in (0, 1, 3)] + [row(3, 2, [0, 1, 2, 3], digest="bad")]
    assert divergence(rows) == {"majority": [0, 1, 3], "minority": [2], "digest": "good"}
    tie = [row(3, 0, [0, 1], digest="x"), row(3, 1, [0, 1], digest="y")]
    assert divergence(tie)["majority"] == [0]
    assert divergence([row(3, k, [0, 1]) for k in range(2)]) is None


def test_status_of_a_finished_run_reads_its_cache_and_warns(cli, state_dir, tmp_path):
    from diloco.runrecord.state import RunRecord

    store_uri = (tmp_path / "store").as_uri()
    store = open_store(store_uri)
    run = "solo-20260101-000000-abcd"
    for r in (1, 2, 3):  # two replicas that never met: each round had one member
        write_round(store, run, r, [row(r, 0, [0])])
    spec = {"name": "solo", "backend": "local", "replicas": 2, "entrypoint": "x:y", "workdir": str(tmp_path),
            "timeout": 60.0}
    RunRecord.create(run, {"spec": spec, "backend": "local", "state": "RUNNING",
                           "launch": {"n_replicas": 2, "rendezvous": store_uri}})
    out = cli("status", run, check_rc=0).stdout
    assert "WARNING: every round so far (1-3) had a single member although the run has 2 replicas" in out
    write_round(store, run, 4, [row(4, 0, [0, 1], digest="a"), row(4, 1, [0, 1], digest="b")])
    out = cli("status", run, check_rc=0).stdout
    assert "single member" not in out
    assert "replicas [1] held a global state different from [0] at round 4" in out
    assert (state_dir / "runs" / run / "rounds.jsonl").read_text().count("\n") == 4  # 1-3, then only 4
    import shutil

    shutil.rmtree(tmp_path / "store")  # the store is gone (or unreachable from this shell): the cache answers
    again = cli("status", run, check_rc=0).stdout
    assert "rounds: 4" in again and "held a global state different" in again


def test_supervisor_turns_summaries_into_events(state_dir, tmp_path):
    from diloco.local.executor import LocalProcessExecutor
    from diloco.runrecord.state import RunRecord
    from diloco.request import LaunchRequest
    from diloco.supervise.supervisor import Supervisor

    store_uri = (tmp_path / "store").as_uri()
    store = open_store(store_uri)
    run = "ev-20260101-000000-abcd"
    incident = {"round": 2, "object": f"{run}/r00000002/scatter/0/1", "writer": 1, "problem": "checksum mismatch",
                "action": "left out of shard 0's mean by rank 0"}
    write_round(store, run, 1, [row(1, 0, [0])])
    write_round(store, run, 2, [row(2, 0, [0], incidents=[incident])])
    record = RunRecord.create(run, {"state": "HEALTHY"})
    request = LaunchRequest(run_id=run, n_replicas=2, entrypoint="x:y", timeout=60, rendezvous=store_uri)
    sup = Supervisor(LocalProcessExecutor(), record, request, {})
    assert sup.rounds.poll(final=True)
    events = [e["event"] for e in record.events()]
    assert events == ["round", "training_alone", "round", "incident"]
    assert sup.rounds.health["alone"]["through_round"] == 2
    write_round(store, run, 3, [row(3, 0, [0, 1], digest="a"), row(3, 1, [0, 1], digest="b")])
    assert sup.rounds.poll(final=True)
    kinds = [e["event"] for e in record.events()]
    assert kinds[-2:] == ["round", "diverged"] and "alone" not in sup.rounds.health  # they met at last
    sup.save()
    assert RunRecord.load(run).data["last_round"] == 3  # saved, so a resumed launcher starts after it
    late = {**incident, "round": 3, "writer": 2, "replica": 2, "action": "rank 2 reset its model"}
    store.put(RunKeys(run).metrics(3, 2), row(3, 2, [0, 1, 2], incidents=[late]).to_json())
    write_round(store, run, 4, [row(4, 0, [0, 1, 2]), row(4, 1, [0, 1, 2])])  # rank 2's row still to come
    assert sup.rounds.poll(final=True)
    store.put(RunKeys(run).metrics(4, 2), row(4, 2, [0, 1, 2], incidents=[{**late, "round": 4}]).to_json())
    assert sup.rounds.poll(final=True)
    got = [(e["round"], e.get("late")) for e in record.events() if e["event"] == "incident"]
    assert got == [(2, None), (4, True)]


class LauncherPolicyStore:
    """A store as the SageMaker launcher's documented policy sees it: GET, LIST and PUT allowed,
    DELETE refused (AccessDenied), and PUTs that fail while `writes_fail` is set (a full disk)."""

    def __init__(self, store):
        self.store, self.writes_fail, self.puts = store, False, []

    def get(self, key):
        return self.store.get(key)

    def list(self, prefix, offset=None):
        return self.store.list(prefix, offset=offset)

    def put(self, key, data, **kw):
        if self.writes_fail:
            raise OSError("No space left on device")
        self.puts.append(key)
        return self.store.put(key, data, **kw)

    def delete(self, key):
        raise PermissionError("AccessDenied: not authorized to perform s3:DeleteObject")


def test_the_launchers_write_proof_needs_only_a_put_and_never_loses_the_rounds_it_read(tmp_path, monkeypatch):
    """The launcher proves every 30 s that the store takes writes. It once did it with a PUT and a
    DELETE, which the SageMaker launcher's policy does not grant: 30 s into a run the store read
    as unreachable, and the rounds read in the same look were dropped, never to become events."""
    import diloco.store.objectstore
    from diloco.runrecord.roundwatch import WRITE_EVERY, RoundWatcher
    from diloco.runrecord.state import RunRecord

    uri, run = f"memory://{uuid.uuid4().hex}", "run-w"
    store = LauncherPolicyStore(open_store(uri))
    monkeypatch.setattr(diloco.store.objectstore, "open_store", lambda *a, **k: store)
    now = [0.0]
    record = RunRecord(run, {}, root=tmp_path)
    record.dir.mkdir(parents=True)
    watch = RoundWatcher(record, rendezvous=uri, run_id=run, n_replicas=2, clock=lambda: now[0])

    def events():
        return [(e["event"], e.get("round")) for e in map(json.loads, record.events_path.read_text().splitlines())]

    for r in (1, 2, 3, 4):
        write_round(store.store, run, r, [row(r, k, [0, 1]) for k in range(2)])
        now[0] += WRITE_EVERY / 2  # a look, and every other look proves writes
        assert watch.poll()
    assert events() == [("round", 1), ("round", 2), ("round", 3), ("round", 4)]  # no store_unreachable
    assert store.puts == [RunKeys(run).probe("launcher")] * 2

    store.writes_fail = True  # a full disk: reads go on, writes fail
    write_round(store.store, run, 5, [row(5, k, [0, 1]) for k in range(2)])
    now[0] += WRITE_EVERY
    assert watch.poll() and watch.store_gone_for() == 0.0
    assert events()[-2:] == [("round", 5), ("store_unreachable", None)]  # round 5 recorded all the same
    now[0] += 5
    assert watch.store_gone_for() == 5
    store.writes_fail = False
    now[0] += 1  # while away, every look proves writes again
    assert watch.poll() and events()[-1] == ("store_back", None) and watch.store_gone_for() == 0.0
