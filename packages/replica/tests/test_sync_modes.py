"""The sync-hiding modes (fragments, overlap, int4, topk) across real processes: every applied
round leaves all replicas bit-identical, bytes stay at the codec's bound, a replica of several
processes overlaps its lanes. (A late replica in each mode: test_diloco_processes.py; a killed
one, through the launcher: tests/test_fault_injection.py.)"""

from __future__ import annotations

import math

import pytest

from diloco_replica.transport.codecs import INT4_BLOCK, TOPK_BLOCK

# Overlap with fragments and fp32 is checked round by round in test_untrusted_objects.py (a
# replica gone NaN, [overlap+fragments]), and here with topk.
MODES = {
    "fragments": {"fragments": 3},
    "overlap": {"overlap": True},
    "int4": {"transport": "int4"},
    "topk": {"transport": "topk", "topk_density": 0.01},
    "overlap+fragments+topk": {"overlap": True, "fragments": 3, "transport": "topk", "topk_density": 0.01},
    "overlap+delay+fragments+int4": {"overlap": True, "overlap_delay": 1, "fragments": 3, "transport": "int4"},
    "overlap+delay (process)": {"overlap": True, "overlap_delay": 2, "exchange": "process"},
}


# The two plain codec runs also check a round's bytes against the codec's bound: on a model large
# enough for the bound to show (dim 256) and with no checkpoint inside the run (its bytes are not
# a round's; the last round's is written after its row).
AT_THE_BOUND = {"int4": 0.01, "topk": 0.01}  # mode -> topk density


# Three replicas: a shard boundary that does not divide the model evenly, and every replica both
# the reducer of a shard and a contributor to two others', with a quarter fewer processes to start
# than four (a replica's start, torch's import, costs more CPU than its rounds here).
REPLICAS = 3


@pytest.mark.parametrize("mode", MODES)
def test_every_applied_round_leaves_replicas_bit_identical(replicas, store_uri, mode):
    bounded = mode in AT_THE_BOUND
    settings = {"sync_every": 3, "checkpoint_every": 100 if bounded else 4, **MODES[mode]}
    handles = replicas.launch("mlp_rounds", REPLICAS, rendezvous=store_uri, settings=settings,
                              args={"steps": 12, "dim": 256 if bounded else 64})
    results = replicas.results(handles)
    rounds = 12 // (3 // settings.get("fragments", 1))
    seen = set.intersection(*(set(r["hashes"]) for r in results))
    # with overlap the last round is merged when the step loop ends (its row is not returned to the loop)
    assert len(seen) >= rounds - (1 if settings.get("overlap") else 0), (mode, seen)
    for rnd in seen:
        assert len({r["hashes"][rnd] for r in results}) == 1, f"{mode}: replicas diverge after round {rnd}"
    assert len({r["final"] for r in results}) == 1
    assert all(x["members"] == list(range(REPLICAS)) for r in results for x in r["rounds"])
    if bounded:
        assert_bytes_at_the_codec_bound(results, settings["transport"], AT_THE_BOUND[mode])


def assert_bytes_at_the_codec_bound(results: list[dict], codec: str, density: float) -> None:
    n, numel = len(results), results[0]["numel"]
    fp32_up = 4 * numel
    for r in results:
        assert r["rounds"], "no round rows to check"
        for rnd in r["rounds"]:
            if codec == "int4":  # up: S at 4 bits plus one fp16 scale per block; down 2(N-1)/N of that
                S = numel * (0.5 + 2 / INT4_BLOCK)
                assert S <= rnd["bytes_up"] <= 1.01 * S + 4096, rnd
                assert rnd["bytes_down"] <= 1.01 * 2 * (n - 1) / n * S + 4096, rnd
            else:  # 3 bytes per kept element: density·P/N per contribution, at most N·density·P/N per mean
                kept = math.ceil(density * TOPK_BLOCK) / TOPK_BLOCK
                up = 3 * numel * ((n - 1) / n * kept + kept)            # N−1 contributions out, one mean
                down = 3 * numel * ((n - 1) / n * kept + (n - 1) * kept)  # N−1 contributions in, N−1 means
                assert rnd["bytes_up"] <= 1.05 * up + 8192, (rnd, up)
                assert rnd["bytes_down"] <= 1.05 * down + 8192, (rnd, down)
                assert rnd["bytes_up"] + rnd["bytes_down"] < (fp32_up * 2.5) / 30, rnd


@pytest.mark.parametrize("delay", [None, 1])
def test_a_replica_of_two_processes_overlaps_fragments_and_ends_on_the_global_model(replicas, store_uri, delay):
    """Lanes: each process exchanges its lane's fragment in the background over its own gloo
    group; the merge writes every lane's fragment into every process's copy of the model (at the
    next round, or with a delay at that step, in every lane at once)."""
    from test_lanes import lane_results

    handles = replicas.launch("plain_lanes", 2, rendezvous=store_uri, processes=2,
                              settings={"sync_every": 4, "fragments": 2, "overlap": True, "checkpoint_every": 2,
                                        "overlap_delay": delay},
                              args={"steps": 16, "dim": 16})
    replicas.results(handles)
    lanes = lane_results(replicas.executor, handles)
    assert sorted((x["rank"], x["lane"]) for x in lanes) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {x["rounds"] for x in lanes} == {8}
    assert len({x["final"] for x in lanes}) == 1
