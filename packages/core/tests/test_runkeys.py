"""The store layout, every key family once, as the exact names a run's store holds: a change to
`diloco.store.runkeys` that would move an object (and strand the runs, launchers and replicas of the
version before) fails here. Written out by hand, never built with the code under test."""

from __future__ import annotations

import pytest

from diloco.store.runkeys import RunKeys, scale_seq

K = RunKeys("run-7")

LAYOUT = [
    (K.round(3), "run-7/r00000003"),
    (K.scatter(3, 5, 2, 1), "run-7/r00000003/scatter/5/2.1"),
    (K.ready(3), "run-7/r00000003/ready/"),
    (K.ready(3, 2, 4, 9), "run-7/r00000003/ready/2.4.9"),
    (K.members(3), "run-7/r00000003/members.json"),
    (K.reduced(3), "run-7/r00000003/reduced/"),
    (K.reduced(3, 5), "run-7/r00000003/reduced/5/mean"),
    (K.repair(3), "run-7/r00000003/repair/"),
    (K.repair(3, 5), "run-7/r00000003/repair/5"),
    (K.repaired(3, 5), "run-7/r00000003/repaired/5"),
    (K.claim(3, 5, 1), "run-7/r00000003/claim/5.1"),
    (K.checkpoints(), "run-7/ckpt/"),
    (K.checkpoint(4), "run-7/ckpt/r00000004/"),
    (K.checkpoint(4, (0, 1024)), "run-7/ckpt/r00000004/0-1024"),
    (K.checkpoint(4, "void"), "run-7/ckpt/r00000004/void"),
    (K.model(), "run-7/model.json"),
    (K.model_config(), "run-7/model-config.json"),
    (K.low_water(), "run-7/history/"),
    (K.low_water(12), "run-7/history/gc-through-r00000012"),
    (K.roster(), "run-7/roster/"),
    (K.scale(2), "run-7/roster/scale-00000002.json"),
    (K.join(3, 14, 2), "run-7/roster/join-3.14.2"),
    (K.away(3, 1), "run-7/roster/away-3.1"),
    (K.metrics(), "run-7/metrics/"),
    (K.metrics(3), "run-7/metrics/r00000003/"),
    (K.metrics(3, 2), "run-7/metrics/r00000003/rank-2.json"),
    (K.summary(), "run-7/rounds/"),
    (K.summary(3), "run-7/rounds/r00000003.json"),
    (K.artifact(), "run-7/artifacts/"),
    (K.artifact("summary.txt"), "run-7/artifacts/summary.txt"),
    (K.probe(), "run-7/probe/"),
    (K.probe("launcher-ab12"), "run-7/probe/launcher-ab12"),
]


@pytest.mark.parametrize("key, want", LAYOUT, ids=[w for _, w in LAYOUT])
def test_every_key_family_names_what_the_store_holds(key, want):
    assert key == want


def test_every_method_of_the_layout_is_in_the_table():
    """A family added to RunKeys without its line above would be a key no test pins."""
    families = {name for name in vars(RunKeys) if not name.startswith("_") and callable(vars(RunKeys)[name])}
    named = {"round", "scatter", "ready", "members", "reduced", "repair", "repaired", "claim", "checkpoints",
             "checkpoint", "model", "model_config", "low_water", "roster", "scale", "join", "away", "metrics", "summary", "artifact", "probe"}
    assert families == named


@pytest.mark.parametrize("name, seq", [
    ("scale-00000002.json", 2), ("scale-2.json", 2), ("scale-.json", None), ("scale-0x2.json", None),
    ("scale-00000002.json.tmp", None), ("join-3.14.2", None), ("away-3.1", None), ("scale-" + "9" * 13 + ".json", None),
])
def test_a_scale_target_is_known_by_its_name_and_nothing_else_is(name, seq):
    assert scale_seq(name) == seq
