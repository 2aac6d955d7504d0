"""Resizing a run (`diloco.store.scaling`): which ranks come and go, as a table; requests and the
target the replicas read, checked; and the supervisor carrying a request out, with a fake
backend (the end-to-end runs are in tests/test_elastic.py)."""

from __future__ import annotations

import json

import pytest

from diloco.errors import UserError
from diloco.store.scaling import parse_roster, pending, plan_resize, roster_body


@pytest.mark.parametrize("active, next_rank, group, replicas, added, retired", [
    ({"g0": [0, 1]}, 2, "g0", 4, [2, 3], []),                      # grow: new ids after every id used
    ({"g0": [0, 1, 2, 3]}, 4, "g0", 2, [], [2, 3]),                # shrink: the highest ranks leave
    ({"g0": [0, 1]}, 4, "g0", 3, [4], []),                         # ids 2, 3 were used (and retired): never again
    ({"a": [0, 1], "b": [2]}, 3, "a", 3, [3], []),                 # a group grows past another group's ranks
    ({"a": [0, 1, 3], "b": [2]}, 4, "a", 1, [], [1, 3]),           # and shrinks by its own highest
    ({"a": [0], "b": [1]}, 2, "b", 0, [], [1]),                    # a group given back entirely
    ({"g0": [0, 1]}, 2, "g0", 2, [], []),                          # the same size: nothing
    ({"a": [0]}, 1, "b", 2, [1, 2], []),                           # a group with no replica yet
])
def test_a_resize_adds_new_ids_or_retires_the_groups_highest(active, next_rank, group, replicas, added, retired):
    assert plan_resize(active, next_rank, group, replicas) == (added, retired)


@pytest.mark.parametrize("body, problem", [
    (b"{", "not JSON"),
    (json.dumps({"kind": "x", "run": "r", "seq": 1, "ranks": [0]}).encode(), "not a roster target"),
    (json.dumps({"kind": "diloco-roster", "run": "other", "seq": 1, "ranks": [0]}).encode(), "not a roster target"),
    (json.dumps({"kind": "diloco-roster", "run": "r", "seq": 2, "ranks": [0]}).encode(), "its seq must be 1"),
    (json.dumps({"kind": "diloco-roster", "run": "r", "seq": 1, "ranks": [1, 0]}).encode(), "ascending"),
    (json.dumps({"kind": "diloco-roster", "run": "r", "seq": 1, "ranks": []}).encode(), "ascending"),
    (json.dumps({"kind": "diloco-roster", "run": "r", "seq": 1, "ranks": [True]}).encode(), "ascending"),
    (json.dumps({"kind": "diloco-roster", "run": "r", "seq": 1, "ranks": [-1]}).encode(), "ascending"),
])
def test_a_target_read_from_the_store_is_checked(body, problem):
    with pytest.raises(ValueError, match=problem):
        parse_roster("r", 1, body)
    assert parse_roster("r", 3, roster_body("r", 3, [4, 0, 2])) == [0, 2, 4]


class _Record:
    def __init__(self, path):
        self.dir = path


def test_requests_are_applied_oldest_first_and_a_malformed_one_is_skipped(tmp_path):
    folder = tmp_path / "scale"
    folder.mkdir()
    (folder / "0001-a.json").write_text(json.dumps({"replicas": 3, "group": None, "at": 1.0}))
    (folder / "0002-b.json").write_text(json.dumps({"replicas": 5, "group": "gpu", "at": 2.0}))
    (folder / "0003-c.json").write_text("{not json")
    (folder / "0004-d.json").write_text(json.dumps({"replicas": "9"}))
    got = pending(_Record(tmp_path), applied=["0001-a"])
    assert [(r.name, r.replicas, r.group) for r in got] == [("0002-b", 5, "gpu")]


def test_scale_through_the_cli_is_one_line_for_a_run_that_is_not_there(cli):
    out = cli("scale", "nosuch-run", "3")
    assert out.returncode == 2 and out.stderr.startswith("error: ") and len(out.stderr.strip().splitlines()) == 1
    with pytest.raises(UserError, match="has ended"):
        from diloco.store.scaling import request_scale

        class Ended:
            run_id, ended, state = "r", True, "SUCCEEDED"

        request_scale(Ended(), 2, None)


def test_a_run_is_scaled_only_once_it_trains(tmp_path):
    """Round 1's replicas are the launch's, written with round 0's checkpoint: a replica added
    before that could write a round 0 of its own."""
    from diloco.store.scaling import request_scale
    from diloco.spec.runspec import parse_spec

    class Starting:
        run_id, ended, state, dir = "r", False, "HEALTHY", tmp_path
        spec = parse_spec({"entrypoint": "job:main", "backend": "local", "replicas": 2}, base_dir=tmp_path)
        data, ranks, rank_groups = {"last_round": 0}, [], {}

    with pytest.raises(UserError, match="has not finished its first round yet"):
        request_scale(Starting(), 3, None)
    Starting.data = {"last_round": 1}
    assert request_scale(Starting(), 3, None).replicas == 3 and len(list((tmp_path / "scale").iterdir())) == 1


def test_the_bar_shows_the_last_rounds_members_against_the_target_per_group():
    from diloco.observe.progress import progress_line, progress_of

    spec = {"groups": [{"name": "node", "first_rank": 0, "replicas": 1},
                       {"name": "singles", "first_rank": 1, "replicas": 2}]}
    data = {"state": "HEALTHY", "launch": {"n_replicas": 3}, "target_replicas": 4, "spec": spec,
            "scaled_ranks": {"3": "singles", "4": "singles"},
            "ranks": [{"rank": 2, "retired": True}]}  # singles: ranks 1, 3, 4 now (2 retired)
    events = [{"t": 100.0, "event": "launch"},
              {"t": 110.0, "event": "round", "round": 7, "step": 70, "members": [0, 1, 3]}]
    p = progress_of(data, events, now=111.0)
    assert p.replicas == 4 and p.members == 3 and p.groups == {"node": [1, 1], "singles": [2, 3]}
    assert "members 3/4" in progress_line(p)
