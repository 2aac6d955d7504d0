"""Progress, stragglers, the estimate and metric sinks, from the launcher's side (no torch)."""

from __future__ import annotations

import json
import sys
import types

import pytest

from diloco.errors import SpecError, UserError
from diloco.spec.estimate import estimate, format_estimate, load_prices
from diloco.store.metrics import RoundMetrics, RoundSummary
from diloco.observe.progress import progress_line, progress_of, straggler_lines, timeline_rows
from diloco.spec.runspec import parse_spec
from diloco.store.wiresize import expected_payload_nbytes, payload_nbytes


def spec_of(tmp_path, **diloco):
    return parse_spec({"backend": "local", "replicas": 4, "entrypoint": "job:main", "diloco": diloco,
                       "rendezvous": "s3://bucket/runs"}, base_dir=tmp_path)


def row(rank, wait, *, r=1, member=True):
    return RoundMetrics(round=r, rank=rank, members=[0, 1, 2, 3], member=member, compute_s=1.0, sync_s=wait + 0.1,
                        phases={"compute": 1.0, "upload": 0.05, "wait": wait, "reduce": 0.02, "download": 0.03,
                                "outer": 0.01}, step=20 * r, total_steps=100, parameters=1000)


def test_the_straggler_is_the_last_to_arrive_and_its_cost_is_everyone_elses_wait():
    s = RoundSummary.from_rows(1, [row(0, 0.9), row(1, 1.1), row(2, 0.001), row(3, 1.0)])
    assert s.straggler == 2 and s.waited_s == pytest.approx(3.0)
    assert s.step == 20 and s.total_steps == 100 and s.parameters == 1000
    # a replica that adopted the round (not a member) is neither a straggler nor waited on
    s = RoundSummary.from_rows(1, [row(0, 0.5), row(1, 0.2), row(2, 0.0, member=False)])
    assert s.straggler == 1 and s.waited_s == pytest.approx(0.5)
    rows = timeline_rows([s])
    assert [x["straggler"] for x in rows] == [False, True, False] and rows[0]["wait"] == 0.5
    assert straggler_lines([s, s]) == ["rank 1: straggler in 2 of 2 rounds, others waited 1.0 replica-s for it"]


def test_progress_eta_from_the_step_rate_of_recent_rounds():
    events = [{"event": "launch", "t": 100.0}] + [
        {"event": "round", "t": 100.0 + 10 * r, "round": r, "step": 20 * r, "total_steps": 200, "members": [0, 1],
         "tokens_per_s": 500.0, "straggler": 1, "waited_s": 2.0} for r in range(1, 6)]
    p = progress_of({"state": "HEALTHY", "launch": {"n_replicas": 2}, "restarts_used": 1}, events, now=150.0)
    assert (p.step, p.total_steps, p.round, p.members, p.restarts) == (100, 200, 5, 2, 1)
    assert p.steps_per_s == pytest.approx(2.0) and p.eta_s == pytest.approx(50.0)
    line = progress_line(p)
    assert "step 100/200" in line and "ETA 0:00:50" in line and "members 2/2" in line and "straggler 1" in line
    assert "waiting for round 1" in progress_line(progress_of({"state": "HEALTHY"}, events[:1], now=101.0))


def test_estimate_counts_the_all_reduce_at_the_byte_bound(tmp_path):
    e = estimate(spec_of(tmp_path, parameters=1_000_000, total_steps=1000, sync_every=50))
    shard = 1_000_000 / 4 * 4  # fp32 bytes of one shard
    assert e.rounds == 20
    assert e.round.bytes_up == pytest.approx(4 * shard, rel=0.01)       # N−1 shards + 1 reduced = S
    assert e.round.bytes_down == pytest.approx(6 * shard, rel=0.01)     # 2(N−1)/N·S
    # steady rounds: ready + roster + reduced + repair requests; the first also checks the low-water mark
    assert (e.round.puts, e.round.lists) == (6, 4) and e.first_round.lists == 4
    assert e.first_round.gets == e.round.gets + 1  # members.json, before it joins
    assert e.run.bytes_down > 20 * 4 * e.round.bytes_down * 0.99
    assert e.cost["transfer_internet"] == pytest.approx(e.run.bytes_down / 1e9 * 0.09)
    text = format_estimate(e)
    assert "1,000,000 parameters (spec)" in text and "whole run (20 rounds)" in text and "$" in text
    json.dumps(e.to_dict())
    # fragments and codecs shrink a round; an unknown size says how to give it
    e4 = estimate(spec_of(tmp_path, parameters=1_000_000, total_steps=1000, sync_every=50, fragments=5,
                          transport="int4"))
    assert e4.round.bytes_up < e.round.bytes_up / 5 * 0.13 and e4.rounds == 100
    assert "set [diloco] parameters" in format_estimate(estimate(spec_of(tmp_path)))


def test_payload_sizes_follow_the_codecs_layout():
    assert payload_nbytes(4096, "int8") == 4096 + 4 * 2
    assert payload_nbytes(300, "int4") == 150 + 2 * 2
    assert expected_payload_nbytes(8192, "topk", density=0.01) == 6 * 2 + 3 * 2 * 41
    assert expected_payload_nbytes(8192, "topk", density=0.01, union_of=4) == 6 * 2 + 3 * 2 * 164


def test_prices_are_overridable_and_checked(tmp_path, monkeypatch):
    assert load_prices()["requests"]["put"] == 0.005 and load_prices()["as_of"]
    override = tmp_path / "p.toml"
    override.write_text('source = "our discount"\n[transfer]\ninternet = 0.05\n')
    monkeypatch.setenv("DILOCO_PRICES", str(override))
    prices = load_prices()
    assert prices["transfer"]["internet"] == 0.05 and prices["transfer"]["cross_region"] == 0.02
    assert "our discount" in prices["source"]
    override.write_text("[requests]\nget = -1\n")
    with pytest.raises(UserError, match="requests.get"):
        load_prices()
    monkeypatch.setenv("DILOCO_PRICES", str(tmp_path / "none.toml"))
    with pytest.raises(UserError, match="does not exist"):
        load_prices()


def test_the_rendezvous_scheme_picks_the_clouds_prices(tmp_path, monkeypatch):
    spec = parse_spec({"backend": "local", "replicas": 2, "entrypoint": "m:f",
                       "diloco": {"parameters": 10_000_000, "total_steps": 1000}})
    by_cloud = {}
    for uri, cloud in (("s3://b/p", "aws"), ("gs://b/p", "gcp"), ("az://c/p", "azure"),
                       ("abfss://c@acct.dfs.core.windows.net/p", "azure"),
                       ("https://acct.blob.core.windows.net/c/p", "azure"), ("file:///tmp/x", "aws")):
        spec.rendezvous = uri
        est = estimate(spec)
        assert est.prices["cloud"] == cloud, uri
        by_cloud[cloud] = est.cost
        assert f"prices                 {cloud}, " in format_estimate(est)
    # the same traffic read over the internet costs what each cloud's egress price says
    assert by_cloud["gcp"]["transfer_internet"] / by_cloud["aws"]["transfer_internet"] == pytest.approx(0.12 / 0.09)
    assert by_cloud["azure"]["requests"] > by_cloud["aws"]["requests"]
    override = tmp_path / "p.toml"
    override.write_text("[gcp.transfer]\ninternet = 0.08\n[transfer]\ncross_region = 0.01\n")
    monkeypatch.setenv("DILOCO_PRICES", str(override))
    assert load_prices("gcp")["transfer"] == {"same_region": 0.0, "cross_region": 0.01, "internet": 0.08}
    assert load_prices("aws")["transfer"]["internet"] == 0.09


def test_a_third_party_sink_is_found_through_the_hook_and_gets_every_round(tmp_path, monkeypatch):
    from diloco import hookimpl
    from diloco.plugins import discovery as plugins
    from diloco.plugins.sinks import open_sinks

    got = []

    class ListSink:
        sink_name = "list"

        def __init__(self, run_id, run_dir, *, tag="x"):
            self.tag = tag

        def write(self, summary):
            got.append((self.tag, summary.round))

        def close(self):
            got.append("closed")

    mod = types.ModuleType("diloco_listsink")
    mod.diloco_register_metric_sinks = hookimpl(lambda: [ListSink])
    monkeypatch.setitem(sys.modules, "diloco_listsink", mod)
    monkeypatch.setenv("DILOCO_PLUGINS", "diloco_listsink")
    plugins.reset()
    try:
        sinks = open_sinks({"sinks": ["list"], "list": {"tag": "t"}}, "run-1", tmp_path)
        summary = RoundSummary.from_rows(3, [row(0, 0.1, r=3), row(1, 0.0, r=3)])
        for s in sinks:
            s.write(summary)
            s.close()
        assert got == [("t", 3), "closed"]
        with pytest.raises(SpecError, match=r"\[metrics.list\]"):
            open_sinks({"sinks": ["list"], "list": {"nope": 1}}, "run-1", tmp_path)
    finally:
        plugins.reset()


def test_the_tensorboard_sink_needs_its_extra_or_writes_event_files(tmp_path):
    from diloco.plugins.sinks import TensorBoardSink, chosen, open_sinks

    if not TensorBoardSink.installed():  # diloco-core alone (the isolated env): default off, asked for → the fix
        assert chosen({}) == []
        with pytest.raises(SpecError, match=r"pip install 'diloco-core\[tensorboard\]'"):
            open_sinks({"sinks": ["tensorboard"]}, "run-1", tmp_path)
        return
    assert chosen({}) == ["tensorboard"] and chosen({"sinks": []}) == []
    (sink,) = open_sinks({}, "run-1", tmp_path)
    sink.write(RoundSummary.from_rows(1, [row(0, 0.1), row(1, 0.0)]))
    sink.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
