"""Trust nothing that arrives (issue 24): non-finite contributions, objects that do not fit the
round's layout, and corruption met while rejoining. In-process stores for the protocol, real
processes for what a user sees (round summaries, outcomes, final models)."""

from __future__ import annotations

import json
import math
import struct
import threading
import time
import uuid

import pytest
import xxhash
import torch

from diloco.bootstrap.context import ReplicaContext
from diloco.errors import UserError
from diloco.store.metrics import read_rounds
from diloco.store.objectstore import open_store
from diloco_replica.round.allreduce import StoreAllReduce
from diloco_replica.transport.codecs import sparsify
from diloco_replica.outer.globalstate import GlobalState
from diloco_replica.round.layout import Cut
from diloco_replica.round.state import Round
from diloco.store.runkeys import RunKeys
from diloco_replica.round.streaming import WholeDelta
from diloco_replica.transport.wire import Identity, encode_tensor, joined, pack, unpack

from test_wire_and_faults import run_round

NAN, INF = float("nan"), float("inf")


def plant(store, run: str, r: int, owner: int, src: int, x: torch.Tensor, codec: str = "fp32", *,
          parts=None, numel: int | None = None) -> None:
    """A well-formed contribution from `src` (right identity, valid checksums), plus its ready marker."""
    parts = parts if parts is not None else encode_tensor(x, codec)
    blob = pack(Identity(run, r, "scatter", owner, src), parts, codec=codec, numel=numel or x.numel())
    store.put(f"{run}/r{r:08d}/scatter/{owner}/{src}.0", joined(blob))
    store.put(RunKeys(run).ready(r, src), b"{}")


def lone_reducer_round(store, run: str, n: int, delta: torch.Tensor, codec: str = "fp32"):
    """Only rank 0 runs; the other members' objects were planted, their reduced shards are zeros."""
    for j in range(1, n):
        numel = delta.numel() // n
        blob = pack(Identity(run, 1, "reduced", j, -1), encode_tensor(torch.zeros(numel), codec), codec=codec,
                    numel=numel)
        store.put(f"{run}/r00000001/reduced/{j}/mean", joined(blob))
    ar = StoreAllReduce(store, run, 0, n, codec=codec, round_timeout=2.0, poll_interval=0.005)
    try:
        return ar.run_round(1, delta)
    finally:
        ar.close()


# -- non-finite contributions -------------------------------------------------------------------

def test_a_nonfinite_contribution_is_left_out_named_and_its_sender_told():
    store, run, n = open_store(f"memory://{uuid.uuid4().hex}"), "run-nan", 3
    deltas = [torch.randn(300, generator=torch.Generator().manual_seed(i)) for i in range(n)]
    deltas[1][5], deltas[1][150], deltas[1][299] = NAN, INF, -INF  # one bad value in each of its shards
    out, errors = run_round(store, run, n, [d.clone() for d in deltas])
    assert not errors, errors
    want = (deltas[0] + deltas[2]) / 2
    for res in out.values():
        assert torch.equal(res.mean, out[0].mean) and torch.isfinite(res.mean).all()
        assert res.nonfinite == [1]  # every replica learns who was left out (the sender resets on it)
    assert torch.allclose(out[0].mean, want, atol=1e-6)
    incidents = [i for res in out.values() for i in res.incidents]
    assert sorted(i["object"] for i in incidents) == [f"{run}/r00000001/scatter/{j}/1.0" for j in range(n)]
    for i in incidents:
        assert i["round"] == 1 and i["writer"] == 1 and i["replica"] == 1
        assert "non-finite" in i["problem"] and "left out" in i["action"]
    for j in range(n):
        reduced = unpack(store.get(f"{run}/r00000001/reduced/{j}/mean"), Identity(run, 1, "reduced", j, -1), "k")
        assert reduced.meta["members"] == [0, 2] and reduced.meta["nonfinite"] == [1]


@pytest.mark.parametrize("codec", ["int8", "int4", "topk", "bf16"])
def test_a_nan_update_is_not_laundered_into_finite_values_by_the_transport(codec):
    """int8/int4/topk used to encode a NaN block with scale 1: the NaN decoded as a finite number."""
    store, run, n = open_store(f"memory://{uuid.uuid4().hex}"), f"run-nan-{codec}", 2
    deltas = [torch.randn(8192, generator=torch.Generator().manual_seed(i)) for i in range(n)]
    deltas[1][:] = NAN  # a diverged replica: everything is NaN
    out, errors = run_round(store, run, n, [d.clone() for d in deltas], codec=codec)
    assert not errors, errors
    assert out[0].nonfinite == out[1].nonfinite == [1]
    assert torch.isfinite(out[0].mean).all() and torch.equal(out[0].mean, out[1].mean)


def test_a_round_whose_every_contribution_is_nonfinite_fails_with_one_clear_error():
    store, n = open_store(f"memory://{uuid.uuid4().hex}"), 2
    out, errors = run_round(store, "run-all-nan", n, [torch.full((100,), NAN) for _ in range(n)])
    assert sorted(errors) == [0, 1], out
    for err in errors.values():
        assert isinstance(err, UserError)  # the replica ends with one line (exit 78), the run fails, no relaunch
        assert "every contribution" in str(err) and "non-finite" in str(err) and "\n" not in str(err)
    assert not list(store.list("run-all-nan/r00000001/reduced/"))  # nothing non-finite was published


def test_the_rounds_only_member_gone_nan_is_left_out_not_the_end_of_the_run():
    """Found by the soak: the others of a 4-replica run were absent for a while (killed, paused)
    when the round's only member diverged. That is one replica's divergence, not the run's: its
    update is left out as it would be beside finite ones (the shard's update is zero, published
    like any mean) and it resets, instead of every replica stopping and the run failing."""
    store, run, n = open_store(f"memory://{uuid.uuid4().hex}"), "run-lone-nan", 3
    deltas = [torch.full((100,), NAN), torch.ones(100), torch.ones(100)]
    out, errors = run_round(store, run, n, deltas, skip=(1, 2), timeout=0.3)
    assert not errors, errors
    assert out[0].members == [0] and out[0].nonfinite == [0]  # it resets, as any left-out NaN sender
    assert torch.equal(out[0].mean, torch.zeros(100))
    for j in range(n):
        reduced = unpack(store.get(f"{run}/r00000001/reduced/{j}/mean"), Identity(run, 1, "reduced", j, -1), "k")
        assert reduced.meta["members"] == [] and reduced.meta["nonfinite"] == [0]
        assert "non-finite" in reduced.meta["left_out"]["0"]


def test_a_mean_that_would_overflow_is_never_published():
    store, n = open_store(f"memory://{uuid.uuid4().hex}"), 2
    out, errors = run_round(store, "run-inf", n, [torch.full((100,), 3e38) for _ in range(n)])
    assert sorted(errors) == [0, 1] and all(isinstance(e, UserError) for e in errors.values()), (out, errors)
    assert all("non-finite" in str(e) for e in errors.values())
    assert not list(store.list("run-inf/r00000001/reduced/"))


# -- objects that do not fit the round's layout ------------------------------------------------------

def int4_with_negative_scale(x: torch.Tensor) -> list[memoryview]:
    parts = encode_tensor(x, "int4")
    scales = torch.frombuffer(bytearray(parts[0]), dtype=torch.float16).clone()
    scales[0] = -scales[0]
    return [memoryview(scales.numpy()).cast("B"), parts[1]]


def topk_with_index_outside_its_block(x: torch.Tensor) -> list[memoryview]:
    parts = encode_tensor(sparsify(x, 0.05), "topk")
    idx = torch.frombuffer(bytearray(parts[2]), dtype=torch.int16).clone()
    idx[0] = 4095 + 1  # past the block (the payload's size still matches its counts)
    return [parts[0], parts[1], memoryview(idx.numpy()).cast("B"), parts[3]]


# (name, codec of the round, what rank 1 planted: (tensor, codec, parts, header numel), the problem)
BAD_CONTRIBUTIONS = {
    "one element too many": ("fp32", lambda x: (torch.cat([x, x[:1]]), "fp32", None, None), "layout"),
    "one element too few": ("fp32", lambda x: (x[:-1], "fp32", None, None), "layout"),
    "bf16 in an fp32 round": ("fp32", lambda x: (x, "bf16", None, None), "layout"),
    "int4 scale out of range": ("int4", lambda x: (x, "int4", int4_with_negative_scale(x), None), "scale"),
    "topk index out of its block": ("topk", lambda x: (x, "topk", topk_with_index_outside_its_block(x), None),
                                    "outside its block"),
}


@pytest.mark.parametrize("case", BAD_CONTRIBUTIONS)
def test_a_wellformed_contribution_that_does_not_fit_the_round_is_corrupt_not_a_crash(case):
    """Right identity, valid checksums, wrong layout: left out as corrupt (it used to raise
    RuntimeError in the reducer, and again in every takeover, until the restarts ran out)."""
    codec, make, problem = BAD_CONTRIBUTIONS[case]
    store, run, n = open_store(f"memory://{uuid.uuid4().hex}"), "run-layout", 2
    mine = torch.randn(8192, generator=torch.Generator().manual_seed(0))
    theirs = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    x, plant_codec, parts, numel = make(theirs)
    plant(store, run, 1, 0, 1, x, plant_codec, parts=parts, numel=numel)
    res = lone_reducer_round(store, run, n, mine.clone(), codec)
    [incident] = res.incidents
    assert incident["object"] == f"{run}/r00000001/scatter/0/1.0" and incident["writer"] == 1
    assert problem in incident["problem"] and "left out of shard 0's mean" in incident["action"]
    reduced = unpack(store.get(f"{run}/r00000001/reduced/0/mean"), Identity(run, 1, "reduced", 0, -1), "k")
    assert reduced.meta["members"] == [0] and "1" in reduced.meta["left_out"]
    assert res.nonfinite == []


def test_a_takeover_meeting_a_wrong_length_contribution_leaves_it_out():
    store, run = open_store(f"memory://{uuid.uuid4().hex}"), "run-takeover-len"
    good = torch.full((50,), 2.0)
    plant(store, run, 1, 0, 1, torch.full((51,), 7.0))  # rank 1's part of shard 0: one element too many
    plant(store, run, 1, 0, 2, good)
    ar = StoreAllReduce(store, run, 2, 3, round_timeout=0.5, poll_interval=0.005)
    rnd = Round(1, Cut(150, 0, 150, 3), 2, source=WholeDelta(torch.zeros(150)), members=[0, 1, 2])
    got = ar.reducer.reduce(rnd, 0, takeover=True)
    ar.close()
    # rank 2's own zeros; rank 0 is gone, rank 1's object is out
    assert got.published_here and torch.equal(got.mean, torch.zeros(50))
    assert [i["writer"] for i in rnd.incidents] == [1] and "layout" in rnd.incidents[0]["problem"]


def repacked(blob: bytes, *, extra: int = 0, nan: bool = False) -> bytes:
    """The same fp32 object re-packed whole, with `extra` more elements or a NaN in the middle:
    identity and checksums valid, as a writer bug (not bit rot) leaves it."""
    prefix = struct.Struct("<4sBIQ")  # wire version 3
    _, _, hlen, _ = prefix.unpack_from(blob)
    header = json.loads(blob[prefix.size:prefix.size + hlen])
    values = torch.frombuffer(bytearray(blob[prefix.size + hlen:]), dtype=torch.float32).clone()
    if nan:
        values[values.numel() // 2] = NAN
    payload = values.numpy().tobytes() + b"\0" * (4 * extra)
    header.update(numel=header["numel"] + extra, nbytes=len(payload), xxh3=xxhash.xxh3_64_intdigest(payload))
    raw = json.dumps(header).encode()
    return prefix.pack(b"DLCO", 3, len(raw), xxhash.xxh3_64_intdigest(raw)) + raw + payload


def wrong_length(blob: bytes) -> bytes:
    return repacked(blob, extra=1)


# -- corruption met while rejoining --------------------------------------------------------------------

def train_alone(store, run: str, steps: int, attempt: int) -> torch.Tensor:
    """One replica (world 1), an MLP under DiLoCo with AdamW: a round every step, checkpoints every 2."""
    from diloco_replica import DiLoCo

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diloco = DiLoCo(model, opt, ReplicaContext(0, 1, run, attempt=attempt), store=store, sync_every=1,
                    checkpoint_every=2, round_timeout=1.0, total_steps=steps)
    for step in diloco.steps():
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        loss = (model(x).squeeze(-1) - x.sum(-1)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        diloco.step(loss=loss.item())
    diloco.close()
    return diloco.theta.clone()


@pytest.mark.parametrize("damage", ["bit flip", "wrong length", "non-finite"])
def test_a_bad_checkpoint_met_while_rejoining_is_an_incident_in_the_next_round(damage):
    uri = f"memory://{uuid.uuid4().hex}"
    store, run = open_store(uri), "run-ckpt"
    before = train_alone(store, run, 4, attempt=0)  # rounds 1-4, checkpoints 2 and 4 kept
    [key] = [m["path"] for m in store.list(f"{run}/ckpt/r00000004/")]  # one replica of one lane: one piece
    blob = bytes(store.get(key))
    store.put(key, blob[:-1] + bytes([blob[-1] ^ 0xFF]) if damage == "bit flip" else
              repacked(blob, extra=int(damage == "wrong length"), nan=damage == "non-finite"))
    after = train_alone(store, run, 5, attempt=1)  # rejoins: checkpoint 4 is bad, 2 + replay; then round 5
    rounds = {s.round: s for s in read_rounds(uri, run, store=store, final=True)}
    [incident] = rounds[5].incidents  # what the launcher turns into an `incident` event
    assert incident["object"] == key and incident["during"] == "rejoin"
    assert {"bit flip": "checksum", "wrong length": "layout", "non-finite": "non-finite"}[damage] in incident["problem"]
    assert "checkpoint 4 voided" in incident["action"]
    assert torch.isfinite(after).all() and torch.isfinite(before).all()


def test_a_corrupt_reduced_shard_met_while_replaying_is_an_incident():
    """Replay after a restart reads round 1's reduced shard 1, corrupt at rest; its reducer
    re-publishes it, and the incident is kept for the rejoined replica's next row."""
    store, run, n = open_store(f"memory://{uuid.uuid4().hex}"), "run-replay", 2
    deltas = [torch.randn(64, generator=torch.Generator().manual_seed(i)) for i in range(n)]
    states, ars = {}, {}

    def go(i):
        ars[i] = StoreAllReduce(store, run, i, n, round_timeout=5.0, poll_interval=0.005, poll_max=0.05)
        states[i] = GlobalState(ars[i], 64, lr=0.7, momentum=0.9, nesterov=True, checkpoint_every=10)
        states[i].bootstrap(lambda: torch.zeros(64))
        res = ars[i].run_round(1, deltas[i].clone())
        states[i].apply(1, res.mean, res.members)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    key = f"{run}/r00000001/reduced/1/mean"
    blob = bytearray(store.get(key))
    blob[-1] ^= 0xFF
    store.put(key, bytes(blob))
    restarted = StoreAllReduce(store, run, 0, n, round_timeout=5.0, poll_interval=0.005, poll_max=0.05)
    state = GlobalState(restarted, 64, lr=0.7, momentum=0.9, nesterov=True, checkpoint_every=10)
    t0 = time.monotonic()
    with ars[1].repairs.waiting():  # as rank 1 would, waiting for round 2 (which the replayer holds up)
        assert state.bootstrap(None) == 1 and time.monotonic() - t0 < 5
    assert torch.equal(state.theta, states[1].theta)
    [incident] = restarted.io.take_found()
    assert incident["object"] == key and incident["during"] == "rejoin"
    assert "re-published by its reducer" in incident["action"]
    for ar in (*ars.values(), restarted):
        ar.close()


def test_no_nonfinite_global_state_is_ever_made():
    """θ_0 with NaN is refused; an outer step that overflows stops before its checkpoint is written."""
    store, run = open_store(f"memory://{uuid.uuid4().hex}"), "run-theta"
    ar = StoreAllReduce(store, run, 0, 1, round_timeout=1.0, poll_interval=0.005)
    state = GlobalState(ar, 8, lr=1.0, momentum=0.9, nesterov=True, checkpoint_every=1)
    with pytest.raises(UserError, match="initial parameters hold NaN or Inf"):
        state.bootstrap(lambda: torch.full((8,), NAN))
    state.bootstrap(lambda: torch.full((8,), -3e38))
    with pytest.raises(UserError, match="non-finite"):
        state.apply(1, torch.full((8,), 3e38), [0])  # θ − lr·(g + m·g) overflows
    ar.close()
    assert not list(store.list(f"{run}/ckpt/r00000001/"))  # never checkpointed


# -- real processes: what a user sees ---------------------------------------------------------------

def summaries(store_uri, run_id):
    return {s.round: s for s in read_rounds(store_uri, run_id, final=True)}


@pytest.mark.parametrize("mode", [{}, {"overlap": True, "fragments": 2}, {"transport": "int8"}],
                         ids=["sync", "overlap+fragments", "int8"])
def test_a_replica_gone_nan_is_left_out_reset_and_ends_identical(replicas, store_uri, mode):
    """Rank 2's parameters turn NaN in round 3's inner steps (and AdamW's moments with them). The
    round leaves it out and says so, rank 2 resets to θ_global (parameters and optimizer state)
    and takes part again; every round leaves all four bit-identical and finite."""
    settings = {"sync_every": 4, "round_timeout": 20, **mode}
    stride = 4 // settings.get("fragments", 1)
    nan_round = 3
    handles = replicas.launch("mlp_rounds", 4, rendezvous=store_uri, settings=settings,
                              args={"steps": 24, "dim": 16, "nan_ranks": [2], "nan_step": stride * (nan_round - 1)})
    results = replicas.results(handles, timeout=240)
    assert all(r["finite"] for r in results), "a final model is not finite"
    seen = set.intersection(*(set(r["hashes"]) for r in results))
    assert len(seen) >= 5
    for rnd in seen:
        assert len({r["hashes"][rnd] for r in results}) == 1, f"replicas differ after round {rnd}"
    assert len({r["final"] for r in results}) == 1
    rounds = summaries(store_uri, replicas.run_id)
    bad = rounds[nan_round].incidents
    left_out = [i for i in bad if "left out" in i["action"]]
    assert left_out and all(i["replica"] == 2 and "non-finite" in i["problem"] for i in left_out), bad
    assert all(f"/r{nan_round:08d}/scatter/" in i["object"] and i["object"].endswith("/2.0") for i in left_out)
    [reset] = [i for i in bad if "reset its model" in i["action"]]
    assert reset["replica"] == 2 and "inner optimizer state" in reset["action"]
    # one incident round only (the optimizer's NaN moments were reset too); with overlap the replica
    # learns a round late, so the inner steps it took meanwhile still had NaN losses
    learned = nan_round + (1 if settings.get("overlap") else 0)
    for rnd, summary in rounds.items():
        if rnd > nan_round:
            assert not summary.incidents, (rnd, summary.incidents)
    by_rank = {r["rank"]: r for r in results}
    # rank 2 trains on finite parameters again (a row's loss is the mean of its finite inner losses)
    later = [x["loss"] for x in by_rank[2]["rounds"] if x["round"] > learned]
    assert later and all(loss is not None and math.isfinite(loss) for loss in later), by_rank[2]["rounds"]
    assert by_rank[2]["rounds"][-1]["members"] == [0, 1, 2, 3]


def test_every_replica_gone_nan_fails_with_one_clear_line(replicas, store_uri):
    handles = replicas.launch("mlp_rounds", 3, rendezvous=store_uri, settings={"sync_every": 4, "round_timeout": 20},
                              args={"steps": 24, "dim": 16, "nan_ranks": [0, 1, 2], "nan_step": 5})
    res = replicas.executor.collect(handles, timeout=120)
    for r in res:
        assert r.status == "failed" and r.exit_code == 78, r  # a configuration error: the run fails, no relaunch
        assert "non-finite" in r.error and "every contribution" in r.error and "\n" not in r.error.strip()
    log = replicas.executor.stream_logs(handles[0])
    assert "Traceback" not in log
