"""Rounds that stay right when replicas run elsewhere and the store misbehaves (issue: remote-safe rounds)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import pytest
import torch

from diloco.store.metrics import read_rounds
from diloco.store.objectstore import open_store
from diloco_replica.round.allreduce import StoreAllReduce
from diloco_replica.round.errors import FellBehind
from diloco_replica.round.layout import Cut
from diloco_replica.round.state import Round
from diloco_replica.round.streaming import WholeDelta
from diloco_replica.outer.step import outer_step
from diloco_replica.transport.wire import CorruptObject, Identity, encode_tensor, joined, pack, unpack


# -- the outer step is the same floats everywhere ------------------------------------------------

def reference_step(theta, buf, g, lr, m):
    """numpy float32, one IEEE-rounded operation at a time (numpy never contracts to FMA)."""
    f = np.float32
    buf = buf * f(m) + g
    update = g + buf * f(m)
    return theta - update * f(lr), buf


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_outer_step_is_bit_identical_across_thread_counts_and_offsets(threads):
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(7)
    n = 100_003  # odd: every vector loop has a scalar tail
    theta0, buf0, grad = (torch.randn(n, generator=gen) for _ in range(3))
    want_theta, want_buf = reference_step(theta0.numpy(), buf0.numpy(), grad.numpy(), 0.7, 0.9)
    for offset in range(9):  # misaligned views, as slices of a larger flat buffer are
        big = torch.zeros(n + 16)
        theta = big[offset:offset + n]
        theta.copy_(theta0)
        buf = torch.zeros(n + 16)[offset + 1:offset + 1 + n]
        buf.copy_(buf0)
        outer_step(theta, buf, grad, lr=0.7, momentum=0.9, nesterov=True)
        assert np.array_equal(theta.numpy(), want_theta), f"offset {offset}, {threads} threads"
        assert np.array_equal(buf.numpy(), want_buf)
    torch.set_num_threads(1)


# -- objects: the header is checksummed too ------------------------------------------------------

def test_a_damaged_or_malformed_header_is_a_corrupt_object():
    ident = Identity("run", 3, "reduced", 1, -1)
    blob = bytearray(joined(pack(ident, encode_tensor(torch.randn(64), "fp32"), codec="fp32", numel=64,
                                 meta={"members": [0, 1]})))
    hstart = 17  # magic, version, header length, header XXH3-64
    damaged = bytearray(blob)
    damaged[blob.index(b'"members"') + 2] ^= 0x01  # a flipped bit in the metadata, payload untouched
    with pytest.raises(CorruptObject, match="header checksum mismatch"):
        unpack(bytes(damaged), ident, "k")
    import struct
    import zlib

    header = b"[1, 2, 3]"  # valid JSON, valid checksum, wrong shape
    malformed = struct.pack("<4sBII", b"DLCO", 2, len(header), zlib.crc32(header)) + header
    with pytest.raises(CorruptObject, match="malformed header"):
        unpack(malformed, ident, "k")
    assert hstart == struct.calcsize("<4sBIQ")


def test_objects_of_wire_version_2_written_by_an_older_diloco_are_still_read():
    """Version 3 hashes with XXH3-64; a store holding version-2 objects (CRC-32) stays readable,
    and damage in one is still caught by its own checksum."""
    import struct
    import zlib

    ident = Identity("run", 3, "reduced", 1, -1)
    values = torch.randn(64)
    payload = values.numpy().tobytes()
    header = json.dumps({"run": "run", "round": 3, "kind": "reduced", "owner": 1, "src": -1, "codec": "fp32",
                         "numel": 64, "nbytes": len(payload), "crc32": zlib.crc32(payload), "meta": {}}).encode()
    v2 = struct.pack("<4sBII", b"DLCO", 2, len(header), zlib.crc32(header)) + header + payload
    assert torch.equal(unpack(v2, ident, "k").tensor(), values)
    damaged = bytearray(v2)
    damaged[-1] ^= 0x10
    with pytest.raises(CorruptObject, match="checksum mismatch"):
        unpack(bytes(damaged), ident, "k")
    assert joined(pack(ident, encode_tensor(values, "fp32"), codec="fp32", numel=64))[4] == 3  # writes version 3


# -- history is never rewritten -----------------------------------------------------------------

def test_a_replica_at_round_zero_never_decides_a_collected_round_one():
    store = open_store(f"memory://{uuid.uuid4().hex}")
    store.put("run-lw/history/gc-through-r00000004", b"{}")
    ar = StoreAllReduce(store, "run-lw", 0, 2, round_timeout=0.3, poll_interval=0.01)
    with pytest.raises(FellBehind, match="rounds ≤ 4 were garbage-collected"):
        ar.run_round(1, torch.zeros(8))
    ar.close()
    assert not list(store.list("run-lw/r00000001/"))  # nothing was written for the dead round


# -- races end in "use the published result" -----------------------------------------------------

def test_replaying_a_round_that_retention_deletes_underneath_is_a_rejoin_not_a_crash():
    store = open_store(f"memory://{uuid.uuid4().hex}")
    run, n = "run-v", 2
    deltas = [torch.full((10,), float(i + 1)) for i in range(n)]

    def go(i):
        ar = StoreAllReduce(store, run, i, n, round_timeout=2.0, poll_interval=0.005)
        ar.run_round(1, deltas[i])
        ar.close()

    threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    store.delete(f"{run}/r00000001/reduced/1/mean")  # GC got there first: mark, then delete
    store.put(f"{run}/history/gc-through-r00000001", b"{}")
    replayer = StoreAllReduce(store, run, 0, n, round_timeout=30.0, poll_interval=0.005)
    t0 = time.monotonic()
    with pytest.raises(FellBehind):
        replayer.fetch(1, replayer.cut(10, 0, 10, 1))
    assert time.monotonic() - t0 < 5  # at once, not after the 30 s round timeout
    replayer.close()


def test_a_takeover_after_the_reducer_published_and_cleaned_up_uses_the_published_shard():
    store = open_store(f"memory://{uuid.uuid4().hex}")
    run, n = "run-t", 2
    deltas = [torch.full((10,), float(i + 1)) for i in range(n)]
    results = {}

    def go(i):
        ar = StoreAllReduce(store, run, i, n, round_timeout=2.0, poll_interval=0.005)
        results[i] = ar.run_round(1, deltas[i])
        ar.close()

    threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    for m in range(n):  # the reducer's cleanup has run: inputs gone
        store.delete(f"{run}/r00000001/scatter/0/{m}.0")
    late = StoreAllReduce(store, run, 1, n, round_timeout=0.5, poll_interval=0.005)
    rnd = Round(1, Cut(10, 0, 10, n), 1, source=WholeDelta(deltas[1]), members=[0, 1])
    got = late.reducer.reduce(rnd, 0, takeover=True)
    assert not got.published_here and got.mean is None  # it did not publish a mean of its own inputs alone
    mean = late.repairs.read_reduced(rnd, 0)  # what the round then reads: the published shard
    late.close()
    assert torch.equal(mean, results[0].mean[:5])


def test_only_one_replica_takes_over_a_slow_reducers_shard():
    """Shard 0's reducer stalls past the timeout: one waiting replica (the create-only claim's
    winner) reduces it, the rest wait for its result; every replica ends with the same bytes."""
    store = open_store(f"memory://{uuid.uuid4().hex}")
    run, n, timeout = "run-slow", 4, 0.6
    deltas = [torch.randn(4000, generator=torch.Generator().manual_seed(i)) for i in range(n)]
    results, ars = {}, {}
    scatter_gets = {"shard 0": 0}
    get = store.get

    def counting_get(key):
        if f"{run}/r00000001/scatter/0/" in key:
            scatter_gets["shard 0"] += 1
        return get(key)

    store.get = counting_get

    def go(i):
        ar = StoreAllReduce(store, run, i, n, round_timeout=timeout, poll_interval=0.005, poll_max=0.02)
        if i == 0:  # the slow reducer: its own shards only (a takeover of its own would not be slow)
            reduce = ar.reducer.reduce

            def slow(rnd, j, *, takeover):
                if not takeover:
                    time.sleep(2.5 * timeout)
                return reduce(rnd, j, takeover=takeover)

            ar.reducer.reduce = slow
        ars[i] = ar
        results[i] = ar.run_round(1, deltas[i])

    threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert sorted(j for res in results.values() for j in res.takeovers) == [0]  # exactly one takeover
    assert all(torch.equal(results[0].mean, res.mean) for res in results.values())
    a, b = 0, 1000  # shard 0: its owner's own part never left it, so the takeover averages ranks 1-3
    assert torch.allclose(results[0].mean[a:b], torch.stack(deltas[1:])[:, a:b].mean(0), atol=1e-6)
    assert torch.allclose(results[0].mean[b:], torch.stack(deltas)[:, b:].mean(0), atol=1e-6)
    claims = [m["path"] for m in store.list(f"{run}/r00000001/claim/")]
    assert claims == [f"{run}/r00000001/claim/0.0"]
    # the losers of the claim never fetched shard 0's inputs: the winner (2) and the slow reducer (3) did
    assert scatter_gets["shard 0"] <= 5, scatter_gets
    for ar in ars.values():
        ar.close()


# -- corrupt objects mid-run, real processes --------------------------------------------------------

def summaries(store_uri, run_id):
    return read_rounds(store_uri, run_id, final=True)


@pytest.mark.parametrize("fault, problem", [("DILOCO_FAULT_CORRUPT", "checksum"),
                                            ("DILOCO_FAULT_WRONG_LENGTH", "layout")])  # a bit flipped; a writer bug
@pytest.mark.parametrize("target, action", [("scatter:2:0:1", "left out of shard 0's mean"),
                                            ("reduced:2:1", "re-published by its reducer")])
def test_a_bad_object_mid_run_is_handled_the_same_everywhere(replicas, store_uri, fault, problem, target, action):
    """A corrupt or wrong-length object is an incident, never a crash, and every replica ends the same."""
    handles = replicas.launch("mlp_rounds", 4, rendezvous=store_uri, settings={"sync_every": 2, "round_timeout": 20},
                              args={"steps": 10, "dim": 32}, env={fault: target})
    results = replicas.results(handles, timeout=240)
    for rnd in ("1", "2", "3", "4", "5"):
        assert len({r["hashes"][rnd] for r in results}) == 1, f"replicas differ after round {rnd}"
    rounds = {s.round: s for s in summaries(store_uri, replicas.run_id)}
    incidents = rounds[2].incidents
    assert incidents and all(action in i["action"] and problem in i["problem"] for i in incidents), incidents
    kind, _, owner, *src = target.split(":")
    assert incidents[0]["object"].endswith(f"/r00000002/{kind}/{owner}" + (f"/{src[0]}.0" if src else "/mean"))
    assert incidents[0]["writer"] == (int(src[0]) if src else int(owner))
    assert all(r["rounds"][-1]["members"] == [0, 1, 2, 3] for r in results)


@pytest.mark.parametrize("others", ["train on", "are done"])
def test_a_replica_paused_past_the_retained_history_rejoins_instead_of_rewriting_it(replicas, store_uri, others,
                                                                                    tmp_path):
    """SIGSTOP rank 3 while the others run on and garbage-collect the rounds it would come back to;
    SIGCONT it: it must rejoin from a checkpoint (not decide dead rounds alone), and end identical.
    "are done": it wakes only after the others ended the run and the launcher marked them away, so
    nobody is left to wait for and its round would be decided at once. It is stopped uploading,
    after it looked for the round's record (then undecided): it once decided that round anew with
    itself alone, trained rounds the others had finished long ago and ended on another model."""
    from diloco.store.presence import away_name

    settings = {"sync_every": 2, "round_timeout": 1.0, "checkpoint_every": 2}
    # the others' rounds take 0.2 s, so the run outlasts rank 3's rejoin: no round waits for it
    phases = {"DILOCO_FAULT_PHASE_FILE": str(tmp_path / "phase-{rank}"), "DILOCO_FAULT_PHASE_DELAY": "0.2"}
    handles = replicas.launch("mlp_rounds", 4, rendezvous=store_uri, settings=settings,
                              env=phases if others == "are done" else None,
                              args={"steps": 80 if others == "train on" else 40, "dim": 16, "slow_ranks": [0, 1, 2],
                                    "step_sleep": 0.1})
    metrics = Path(urlparse(store_uri).path) / replicas.run_id / "metrics"

    def rounds_done() -> int:
        return max((int(p.name[1:]) for p in metrics.glob("r*")), default=0) if metrics.exists() else 0

    deadline = time.monotonic() + 120
    while rounds_done() < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    while others == "are done" and time.monotonic() < deadline:  # in the phase file: "upload <round> <pid>"
        marker = tmp_path / "phase-3"
        if marker.exists() and marker.read_text().split()[:1] == ["upload"]:
            break
        time.sleep(0.01)
    pid = handles[3].metadata["pid"]
    os.kill(pid, signal.SIGSTOP)
    stopped_at = rounds_done()
    try:
        if others == "train on":
            while rounds_done() < stopped_at + 8 and time.monotonic() < deadline:
                time.sleep(0.1)
        else:
            replicas.results(handles[:3], timeout=120)
            store = open_store(store_uri)
            for k in range(3):  # what the launcher writes when it sees an attempt end
                store.put(f"{replicas.run_id}/roster/{away_name(k, 0)}", b"")
    finally:
        os.kill(pid, signal.SIGCONT)
    marks = sorted((Path(urlparse(store_uri).path) / replicas.run_id / "history").iterdir())
    assert marks and int(marks[-1].name.rsplit("r", 1)[1]) > stopped_at  # its rounds were collected
    results = replicas.results(handles, timeout=240)
    assert len({r["final"] for r in results}) == 1
    log = replicas.executor.stream_logs(handles[3], n_lines=400)
    assert "garbage-collected" in log and "rejoining" in log
    late = next(r for r in results if r["rank"] == 3)
    if others == "train on":
        assert late["rounds"][-1]["members"] == [0, 1, 2, 3]  # it took part again
    else:
        assert all(row["members"] != [3] for row in late["rounds"])  # never a round of its own


def test_an_injected_divergence_is_detected_and_the_minority_reloads(replicas, store_uri):
    handles = replicas.launch("mlp_rounds", 4, rendezvous=store_uri,
                              settings={"sync_every": 2, "checkpoint_every": 2, "round_timeout": 20},
                              args={"steps": 24, "dim": 16, "perturb_rank": 2, "perturb_round": 3})
    results = replicas.results(handles, timeout=240)
    rounds = {s.round: s for s in summaries(store_uri, replicas.run_id)}
    diverged = [s for s in rounds.values() if s.diverged]
    assert diverged and diverged[0].round == 4 and diverged[0].diverged["minority"] == [2]
    assert diverged[0].diverged["majority"] == [0, 1, 3]
    assert len({r["final"] for r in results}) == 1  # repaired: everyone ends on the majority's state
    assert not rounds[max(rounds)].diverged
    log = replicas.executor.stream_logs(handles[2], n_lines=400)
    assert "diverged from the majority's at round 4" in log


# -- a store that cannot serve a run is refused at start ---------------------------------------------

def test_a_store_that_ignores_create_only_is_refused_at_replica_start(replicas, s3):
    from diloco.testing.s3proxy import FaultyS3Proxy

    with FaultyS3Proxy(s3["env"]["AWS_ENDPOINT_URL"], ignore_conditional=True) as proxy:
        handles = replicas.launch("mlp_rounds", 2, rendezvous=s3["uri"], env={**s3["env"], "AWS_ENDPOINT_URL": proxy.url},
                                  args={"steps": 4, "dim": 8})
        res = replicas.executor.collect(handles, timeout=120)
    for r in res:
        assert r.status == "failed" and r.exit_code == 78, r
        assert "ignores create-only writes" in r.error and "\n" not in r.error.strip()
    log = replicas.executor.stream_logs(handles[0])
    assert "Traceback" not in log and "diloco: error: rendezvous 's3://diloco-test/runs'" in log


def test_a_reducer_that_moved_on_still_repairs_the_shard_a_slow_reader_found_corrupt():
    """Rank 1's reduced shard of round 1 is corrupt at rest; rank 0 reads it late, after rank 1 has
    started round 2. Round 2 cannot form without rank 0, so rank 1 must keep answering round 1's
    repair requests while it waits (it used to stop at once, and rank 0's round failed)."""
    store = open_store(f"memory://{uuid.uuid4().hex}")
    run, n, timeout = "run-repair-late", 2, 3.0
    deltas = {r: [torch.randn(2000, generator=torch.Generator().manual_seed(10 * r + i)) for i in range(n)]
              for r in (1, 2)}
    results: dict[tuple[int, int], object] = {}
    errors: list[BaseException] = []

    def scenario(ar: StoreAllReduce) -> StoreAllReduce:
        reduce, arrivals = ar.reducer.reduce, ar.gatherer.arrivals

        def damaging(rnd, j, *, takeover):
            reduction = reduce(rnd, j, takeover=takeover)
            if rnd.r == 1 and ar.rank == 1:  # damaged at rest after it was published
                key = ar.io.keys.reduced(rnd.r, j)
                blob = bytearray(store.get(key))
                blob[-1] ^= 0xFF
                store.put(key, bytes(blob))
            return reduction

        def slow(rnd, have):
            if rnd.r == 1 and ar.rank == 0:
                time.sleep(1.0)  # the reader is slow: rank 1 is already in round 2 when it looks
            return arrivals(rnd, have)

        ar.reducer.reduce, ar.gatherer.arrivals = damaging, slow
        return ar

    def go(i):
        ar = scenario(StoreAllReduce(store, run, i, n, round_timeout=timeout, poll_interval=0.005, poll_max=0.05))
        try:
            for r in (1, 2):
                results[(i, r)] = ar.run_round(r, deltas[r][i])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            ar.close()

    threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors, errors
    for r in (1, 2):
        assert results[(0, r)].members == results[(1, r)].members == [0, 1]
        assert torch.equal(results[(0, r)].mean, results[(1, r)].mean)
    assert any("re-published by its reducer" in i["action"] for i in results[(0, 1)].incidents)


# -- a round's summary ---------------------------------------------------------------------------

def test_a_recorder_leaving_does_not_wait_for_a_row_that_may_never_come():
    """A member killed mid-round never writes its row; the recorder (rank 0) waits for it up to
    the round timeout in the background, but closing ends the wait at once: no summary short of a
    row is written, and readers rebuild the round from the rows once it is over."""
    from diloco.store.metrics import RoundMetrics, RoundReader
    from diloco.store.runkeys import RunKeys
    from diloco_replica.records.recorder import Recorder

    store, run = open_store(f"memory://{uuid.uuid4().hex}"), "run-leaving"
    ar = StoreAllReduce(store, run, 0, 2, round_timeout=600.0, poll_interval=0.005, poll_max=0.05)
    recorder = Recorder(ar, log=lambda _: None)
    recorder.write_row(RoundMetrics(round=3, rank=0, members=[0, 1], tokens=5))
    recorder.maybe_summarize(3, [0, 1])  # rank 1's row never comes
    time.sleep(0.2)
    closer = threading.Thread(target=lambda: (recorder.closing.set(), ar.close()))
    closer.start()
    closer.join(timeout=60)  # 600 s if leaving waited for the missing row
    assert not closer.is_alive()
    assert store.get(RunKeys(run).summary(3)) is None
    [rebuilt] = RoundReader(store, run).read_new(final=True)
    assert rebuilt.round == 3 and rebuilt.tokens == 5
