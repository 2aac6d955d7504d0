"""Replica groups: one run over several backends, supervised as one.

A second backend here is a plugin whose replicas are local processes under another name
("nearby"), so every handle says which group's executor started it, relaunched it and polled it.
"""

from __future__ import annotations

import json
import os
import signal

import pytest

from conftest import one_line_error, wait_until, write_spec

NEARBY_PLUGIN = '''
from diloco import hookimpl
from diloco.local.executor import LocalProcessExecutor
from diloco.protocol import Capabilities

class NearbyExecutor(LocalProcessExecutor):
    """Local processes under another backend name: a second backend for a grouped run."""
    backend_name = "nearby"

class FarExecutor(LocalProcessExecutor):
    """Replicas elsewhere: it does not see the launcher's disk."""
    backend_name = "far"
    capabilities = Capabilities(relaunches_one_rank=True, process_groups=True)

class RefusingExecutor(LocalProcessExecutor):
    """Plans, then cannot start anything (a quota, a bad image)."""
    backend_name = "refusing"
    def submit(self, plan):
        from diloco.errors import BackendError
        raise BackendError("quota exceeded for instance type x")

@hookimpl
def diloco_register_executors():
    return [NearbyExecutor, FarExecutor, RefusingExecutor]
'''

GROUPS = '''name = "groups"
entrypoint = "job:main"
timeout = 120
[args]
steps = {steps}
delay = 0.1
[env]
SHARED = "top"
[restart]
backoff = 0.1
[[group]]
name = "here"
replicas = 2
[group.backend]
name = "local"
[[group]]
name = "there"
replicas = 1
timeout = 60
[group.env]
SHARED = "group"
ONLY_THERE = "1"
[group.backend]
name = "{second}"
'''


@pytest.fixture
def plugin_env(project):
    (project / "nearby_plugin.py").write_text(NEARBY_PLUGIN)
    return {"DILOCO_PLUGINS": "nearby_plugin", "PYTHONPATH": str(project), "DILOCO_CONFIG": str(project / "none.toml")}


def grouped(project, *, steps: int = 3, second: str = "nearby", extra: str = "") -> os.PathLike:
    return write_spec(project, GROUPS.format(steps=steps, second=second) + extra)


def start_running(project, plugin_env, state_dir, steps: int, *flags: str):
    """`diloco run` of the grouped spec in its own process, once every rank runs: (launcher, run id,
    its run.json, each rank's pid)."""
    import subprocess
    import sys

    launcher = subprocess.Popen([sys.executable, "-m", "diloco", "run", str(grouped(project, steps=steps)), *flags],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, **plugin_env, "DILOCO_STATE_DIR": str(state_dir)})
    run_id = launcher.stdout.readline().split()[1].rstrip(":")
    record = state_dir / "runs" / run_id / "run.json"
    assert wait_until(lambda: record.exists() and all(
        r.get("status") == "running" for r in json.loads(record.read_text()).get("ranks") or [{}]), timeout=60)
    pids = [r["handle"]["metadata"]["pid"] for r in json.loads(record.read_text())["ranks"]]
    return launcher, run_id, record, pids


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return False
    except ProcessLookupError:
        return True


# -- the spec -------------------------------------------------------------------------------------


def test_groups_number_ranks_group_by_group_and_inherit_the_top_level(project):
    from diloco.spec.runspec import parse_spec

    spec = parse_spec({"entrypoint": "job:main", "gpu": "A10G", "timeout": 99, "region": "us-east-1",
                       "env": {"A": "top", "B": "top"},
                       "group": [{"replicas": 2, "backend": {"name": "local"}},
                                 {"name": "big", "replicas": 3, "gpu": "H100:1", "timeout": 5, "env": {"B": "g"},
                                  "backend": {"name": "nearby", "max_parallel": 2}}]}, base_dir=project)
    a, b = spec.replica_groups()
    assert (a.name, list(a.ranks), a.gpu, a.timeout, a.region) == ("g0", [0, 1], "A10G", 99.0, None)
    assert (b.name, list(b.ranks), b.gpu, b.timeout, b.backend_options) == ("big", [2, 3, 4], "H100:1", 5.0,
                                                                             {"max_parallel": 2})
    assert b.env_over(spec.env) == {"A": "top", "B": "g"} and spec.replicas == 5 and spec.backend == "local+nearby"
    again = parse_spec(spec.to_table(), base_dir=project)  # what a record holds parses back to the same spec
    assert again.replica_groups() == spec.replica_groups() and again.replicas == 5


def test_each_group_gets_its_own_secrets_and_what_no_group_lists_goes_to_all(project, monkeypatch):
    """A group's `secrets` replaces the top-level list for it: AWS keys meant for the Modal group
    never reach the SageMaker jobs (they have their own role). A name every group replaced is read
    from the shell by nobody."""
    from diloco.launching.launcher import plan_run
    from diloco.spec.runspec import parse_spec

    for name, value in {"AWS_ACCESS_KEY_ID": "AKIA-modal", "HF_TOKEN": "hf-1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("UNUSED_TOKEN", raising=False)
    spec = parse_spec({"entrypoint": "job:main", "secrets": ["HF_TOKEN", "AWS_ACCESS_KEY_ID"],
                       "group": [{"name": "modal", "replicas": 1, "backend": {"name": "local"}},
                                 {"name": "sagemaker", "replicas": 2, "secrets": ["HF_TOKEN"],
                                  "backend": {"name": "local"}}]}, base_dir=project)
    assert [g.secrets for g in spec.replica_groups()] == [["HF_TOKEN", "AWS_ACCESS_KEY_ID"], ["HF_TOKEN"]]
    plan = plan_run(spec)
    got = {p.request.ranks: dict(p.request.secrets.reveal()) for p in plan.parts}
    assert got == {(0,): {"HF_TOKEN": "hf-1", "AWS_ACCESS_KEY_ID": "AKIA-modal"}, (1, 2): {"HF_TOKEN": "hf-1"}}
    assert "AKIA-modal" not in json.dumps(plan.body)  # names in the plan, never values
    # every group its own list: the top-level name is needed by nobody, so an unset one is no error
    both = parse_spec({"entrypoint": "job:main", "secrets": ["UNUSED_TOKEN"],
                       "group": [{"replicas": 1, "secrets": ["AWS_ACCESS_KEY_ID"], "backend": {"name": "local"}},
                                 {"replicas": 1, "secrets": [], "backend": {"name": "local"}}]}, base_dir=project)
    assert both.secret_names() == ["AWS_ACCESS_KEY_ID"]
    assert [sorted(p.request.secrets.names) for p in plan_run(both).parts] == [["AWS_ACCESS_KEY_ID"], []]
    assert parse_spec(spec.to_table(), base_dir=project).replica_groups() == spec.replica_groups()


def test_groups_may_run_different_numbers_of_processes_per_replica(project):
    """An 8-GPU node beside single GPUs: each group's replicas run as many processes as its GPUs."""
    from diloco.spec.runspec import parse_spec

    spec = parse_spec({"entrypoint": "job:main",
                       "group": [{"name": "node", "replicas": 1, "gpu": "H100:8", "backend": {"name": "local"}},
                                 {"name": "singles", "replicas": 2, "gpu": "A10G", "backend": {"name": "nearby"}}]},
                      base_dir=project)
    node, singles = spec.replica_groups()
    assert (node.processes_per_replica, singles.processes_per_replica) == (8, 1)
    assert list(node.ranks) == [0] and list(singles.ranks) == [1, 2]


@pytest.mark.parametrize("text, expected", [
    ('replicas = 2\n[[group]]\nreplicas = 1\n[group.backend]\nname = "local"\n',
     "a spec with [[group]] tables has no top-level `replicas`"),
    ('backend = "local"\n[[group]]\nreplicas = 1\n[group.backend]\nname = "local"\n',
     "has no top-level `backend`"),
    ('[[group]]\nreplicas = 1\n', "missing required key `group.backend`"),
    ('[[group]]\n[group.backend]\nname = "local"\n', "missing required key `group.replicas`"),
    ('[[group]]\nname = "a"\nreplicas = 1\n[group.backend]\nname = "local"\n'
     '[[group]]\nname = "a"\nreplicas = 1\n[group.backend]\nname = "local"\n', "two groups are named 'a'"),
    ('[[group]]\nname = "Bad_Name"\nreplicas = 1\n[group.backend]\nname = "local"\n', "`group[0].name` must be lowercase"),
    ('[[group]]\nname = "ok\\n"\nreplicas = 1\n[group.backend]\nname = "local"\n', "`group[0].name` must be lowercase"),
    ('[[group]]\nreplicas = 1\nbogus = 2\n[group.backend]\nname = "local"\n', "unknown key `group.bogus`"),
    ('[[group]]\nreplicas = 3000\n[group.backend]\nname = "local"\n'
     '[[group]]\nreplicas = 3000\n[group.backend]\nname = "local"\n', "at most 4096"),
    ('[diloco]\nmin_members = 3\n[[group]]\nreplicas = 1\n[group.backend]\nname = "local"\n'
     '[[group]]\nreplicas = 1\n[group.backend]\nname = "local"\n', "`diloco.min_members` (3) exceeds"),
    ('[[group]]\nreplicas = 1\n[group.env]\nAWS_SECRET_ACCESS_KEY = "x"\n[group.backend]\nname = "local"\n',
     "AWS_SECRET_ACCESS_KEY"),
    ('[[group]]\nreplicas = 1\ntimeout = nan\n[group.backend]\nname = "local"\n', "timeout"),
    ('group = 3\n', "[[group]] tables"),
    ('[[group]]\nreplicas = 1\n[group.backend]\nname = "nosuch"\n', "group 'g0'"),
])
def test_a_wrong_group_is_one_line_naming_it(cli, project, plugin_env, text, expected):
    spec = write_spec(project, 'entrypoint = "job:main"\n' + text)
    for cmd in ("dryrun", "run"):
        one_line_error(cli(cmd, str(spec), env=plugin_env), expected)


# -- planning: what a dry run shows is what is submitted -------------------------------------------


def test_dryrun_prints_each_groups_plan_and_its_estimate(cli, project, plugin_env):
    spec = grouped(project, extra='[diloco]\nparameters = 1000000\ntotal_steps = 100\nsync_every = 10\n')
    proc = cli("dryrun", str(spec), env=plugin_env, check_rc=0)
    assert "# group here: 2 × local, ranks 0-1\n" in proc.stdout and "# group there: 1 × nearby, rank 2\n" in proc.stdout
    assert "group here" in proc.stderr and "group there" in proc.stderr and "3 replicas" in proc.stderr
    plans = json.loads(cli("dryrun", str(spec), "--format", "json", env=plugin_env, check_rc=0).stdout)
    assert [(p["group"], p["backend"], p["ranks"]) for p in plans] == [("here", "local", [0, 1]),
                                                                       ("there", "nearby", [2])]
    there = plans[1]["plan"]["processes"][0]["env"]
    here = plans[0]["plan"]["processes"][1]["env"]
    assert there["DILOCO_REPLICAS"] == "3" and there["REPLICA_RANK"] == "2" and there["DILOCO_TIMEOUT"] == "60.0"
    assert (there["SHARED"], there["ONLY_THERE"], here["SHARED"]) == ("group", "1", "top") and "ONLY_THERE" not in here
    assert (here["DILOCO_GROUP"], there["DILOCO_GROUP"]) == ("here", "there")


def test_any_remote_group_needs_a_remote_store(cli, project, plugin_env, state_dir):
    spec = grouped(project, second="far")
    one_line_error(cli("dryrun", str(spec), env=plugin_env), "need a shared object store")
    one_line_error(cli("run", str(spec), env=plugin_env), "group 'there' runs on far")
    spec.write_text(spec.read_text().replace('timeout = 120\n', f'timeout = 120\nrendezvous = "{(project / "s").as_uri()}"\n'))
    one_line_error(cli("run", str(spec), env=plugin_env), "which 'far' replicas do not see")
    assert not (state_dir / "runs").exists() or not any((state_dir / "runs").iterdir())


def test_pricing_places_each_group_against_the_stores_region(project):
    from diloco.spec.estimate import estimate
    from diloco.spec.runspec import parse_spec

    table = {"entrypoint": "job:main", "rendezvous": "s3://b/p", "store_region": "us-east-1",
             "diloco": {"parameters": 10_000_000, "total_steps": 100, "sync_every": 10},
             "group": [{"name": "same", "replicas": 2, "region": "us-east-1", "backend": {"name": "eks", "image": "i"}},
                       {"name": "other", "replicas": 2, "backend": {"name": "sagemaker", "region": "eu-west-1"}},
                       {"name": "unknown", "replicas": 2, "backend": {"name": "eks", "image": "i"}},
                       {"name": "out", "replicas": 2, "backend": {"name": "local"}}]}
    pytest.importorskip("diloco_eks")
    pytest.importorskip("diloco_sagemaker")
    est = estimate(parse_spec(table, base_dir=project))
    places = {g.group: g.place for g in est.groups}
    assert places == {"same": "same_region", "other": "cross_region", "unknown": "cross_region", "out": "internet"}
    cost = {g.group: g.transfer_cost for g in est.groups}
    assert cost["same"] == 0 and 0 < cost["other"] == cost["unknown"] < cost["out"]
    # each group's share of the reads is its replicas' share, so the shares add up to the run's
    assert sum(g.bytes_down for g in est.groups) == pytest.approx(est.run.bytes_down)
    # a top-level region is the last resort: a group's backend says where it really runs
    est = estimate(parse_spec({**table, "region": "us-east-1"}, base_dir=project))
    assert {g.group: g.place for g in est.groups} == {"same": "same_region", "other": "cross_region",
                                                      "unknown": "same_region", "out": "internet"}
    # the store the run really uses prices it, when a default (not the spec) chose it
    plain = {k: v for k, v in table.items() if k not in ("rendezvous", "group")}
    est = estimate(parse_spec({**plain, "backend": "local", "replicas": 2}, base_dir=project),
                   rendezvous="gs://bucket/runs")
    assert est.prices["cloud"] == "gcp" and [g.place for g in est.groups] == ["internet"]


# -- running -------------------------------------------------------------------------------------


def test_a_grouped_run_succeeds_and_every_view_names_each_ranks_group(cli, project, plugin_env):
    proc = cli("run", str(grouped(project)), env=plugin_env, check_rc=0)
    assert "here 2 × local, there 1 × nearby" in proc.stdout.splitlines()[0]
    run_id = proc.stdout.split()[1].rstrip(":")
    view = json.loads(cli("status", run_id, "--json", env=plugin_env, check_rc=0).stdout)
    ranks = view["record"]["ranks"]
    assert [(r["group"], r["handle"]["backend_name"], r["status"]) for r in ranks] == [
        ("here", "local", "succeeded"), ("here", "local", "succeeded"), ("there", "nearby", "succeeded")]
    assert view["live"] == {"0": "succeeded", "1": "succeeded", "2": "succeeded"}
    launch = next(e for e in view["events"] if e["event"] == "launch")
    assert launch["groups"] == ["here", "there"]
    table = cli("status", run_id, env=plugin_env, check_rc=0).stdout
    assert "group" in table and "there" in table and "nearby" in table
    listed = cli("list", env=plugin_env, check_rc=0).stdout
    assert "local+nearby" in listed and "3 (here 2, there 1)" in listed
    assert "rank 2/3 step 2" in cli("logs", run_id, "--rank", "2", env=plugin_env, check_rc=0).stdout

    import diloco

    run = diloco.attach(run_id)  # the Python API, from the record alone
    assert [(g.name, g.backend, list(g.ranks)) for g in run.groups()] == [("here", "local", [0, 1]),
                                                                           ("there", "nearby", [2])]
    assert [r.group for r in run.ranks()] == ["here", "here", "there"]


def test_a_killed_replica_is_relaunched_by_its_own_groups_backend(cli, project, plugin_env, state_dir):
    launcher, run_id, record, pids = start_running(project, plugin_env, state_dir, 60)
    os.kill(pids[2], signal.SIGKILL)
    out, _ = launcher.communicate(timeout=120)
    assert launcher.returncode == 0, out
    ranks = json.loads(record.read_text())["ranks"]
    assert [r["restarts"] for r in ranks] == [0, 0, 1]
    assert [(h["backend_name"], h["metadata"]["attempt"]) for h in ranks[2]["attempts"]] == [("nearby", 0),
                                                                                          ("nearby", 1)]
    events = [json.loads(x) for x in (state_dir / "runs" / run_id / "events.jsonl").read_text().splitlines()]
    failed = next(e for e in events if e["event"] == "failed")
    assert (failed["rank"], failed["group"]) == (2, "there") and "group=there" in out


def test_cancel_reaches_every_group(cli, project, plugin_env, state_dir):
    launcher, run_id, record, pids = start_running(project, plugin_env, state_dir, 600)
    assert "cancelled run" in cli("cancel", run_id, env=plugin_env, check_rc=0).stdout
    launcher.communicate(timeout=60)
    assert json.loads(record.read_text())["state"] == "STOPPED"
    assert wait_until(lambda: all(gone(p) for p in pids), timeout=30)


def test_a_group_that_cannot_start_leaves_no_other_group_running(cli, project, plugin_env, state_dir):
    proc = cli("run", str(grouped(project, steps=600, second="refusing")), env=plugin_env)
    assert proc.returncode != 0
    assert "group 'there' (refusing): quota exceeded" in proc.stdout + proc.stderr
    assert "the 2 replica(s) of other groups already started were cancelled" in proc.stdout + proc.stderr
    run_dir = next((state_dir / "runs").iterdir())
    local = state_dir / "local" / run_dir.name
    assert sorted(p.name for p in local.glob("*.cancelled")) == ["rank-0.attempt-0.cancelled",
                                                                 "rank-1.attempt-0.cancelled"]
    pids = [json.loads(p.read_text())["pid"] for p in local.glob("*.started.json")]
    assert wait_until(lambda: all(gone(p) for p in pids), timeout=30)


def test_the_progress_line_counts_members_by_group_and_names_the_stragglers_group():
    from diloco.observe.progress import progress_line, progress_of
    from diloco.spec.runspec import RunSpec

    spec = {"groups": [{"name": "k8s", "replicas": 2, "first_rank": 0}, {"name": "sm", "replicas": 2, "first_rank": 2}]}
    data = {"state": "HEALTHY", "spec": spec, "launch": {"n_replicas": 4}}
    events = [{"event": "launch", "t": 0.0},
              {"event": "round", "t": 10.0, "round": 1, "step": 50, "total_steps": 500, "members": [0, 1, 3],
               "straggler": 3, "waited_s": 4.0}]
    p = progress_of(data, events, now=11.0)
    assert p.groups == {"k8s": [2, 2], "sm": [1, 2]} and p.straggler_group == "sm"
    line = progress_line(p)
    assert "members 3/4 (k8s 2/2, sm 1/2)" in line and "straggler 3 in sm (+4.0 replica-s)" in line
    one = progress_of({**data, "spec": RunSpec.from_dict({**_plain_spec(), "groups": []}).to_dict()}, events, 11.0)
    assert one.groups is None and "(k8s" not in progress_line(one)  # a one-backend run names no group


def _plain_spec() -> dict:
    return {"name": "r", "backend": "local", "replicas": 4, "entrypoint": "job:main", "workdir": ".", "timeout": 60.0}


def test_a_group_that_cannot_relaunch_one_rank_makes_the_run_a_gang(project):
    from diloco.launching.groupexec import GroupedExecutor
    from diloco.spec.groups import ReplicaGroup
    from diloco.local.executor import LocalProcessExecutor
    from diloco.protocol import Capabilities

    class GangOnly(LocalProcessExecutor):
        backend_name = "gang-only"
        capabilities = Capabilities(relaunches_one_rank=False)

    a = ReplicaGroup(name="a", backend="local", replicas=1, first_rank=0, timeout=60.0)
    b = ReplicaGroup(name="b", backend="gang-only", replicas=1, first_rank=1, timeout=60.0)
    both = GroupedExecutor([(a, LocalProcessExecutor), (b, GangOnly)])
    assert not both.capabilities.relaunches_one_rank and not both.capabilities.shares_launcher_filesystem
    alone = GroupedExecutor([(a, LocalProcessExecutor)])
    assert alone.capabilities.relaunches_one_rank and alone.capabilities.shares_launcher_filesystem
    assert both.group_of(1).name == "b"


def test_a_grouped_run_whose_launcher_died_is_resumed_with_every_group(cli, project, plugin_env, state_dir):
    """`diloco resume` rebuilds each group's executor from the record and reattaches to all of them."""
    launcher, run_id, record, _ = start_running(project, plugin_env, state_dir, 40)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    resumed = cli("resume", run_id, env=plugin_env, check_rc=0)
    assert "SUCCEEDED" in resumed.stdout
    ranks = json.loads(record.read_text())["ranks"]
    assert [(r["group"], r["handle"]["backend_name"], r["status"], r["restarts"]) for r in ranks] == [
        ("here", "local", "succeeded", 0), ("here", "local", "succeeded", 0), ("there", "nearby", "succeeded", 0)]


def test_a_shell_without_one_groups_backend_still_sees_and_cancels_the_others(cli, project, plugin_env, state_dir):
    """One group's plugin (or SDK) missing in this shell: status shows the other groups live and
    names the one it cannot reach; cancel stops every replica it can reach and fails naming the
    ranks left, and a shell that has the backend cancels them."""
    launcher, run_id, record, pids = start_running(project, plugin_env, state_dir, 600, "--on-interrupt", "detach")
    launcher.send_signal(signal.SIGKILL)  # no launcher: only `cancel` can stop them
    launcher.wait()
    bare = {"DILOCO_CONFIG": plugin_env["DILOCO_CONFIG"]}  # this shell lacks the "nearby" plugin
    view = json.loads(cli("status", run_id, "--json", env=bare, check_rc=0).stdout)
    assert view["live"] == {"0": "running", "1": "running"} and "group there" in view["live_error"]
    refused = cli("cancel", run_id, env=bare)
    assert refused.returncode == 2 and "cancelled 2 of 3 replicas; ranks [2] (group there)" in refused.stderr
    assert wait_until(lambda: gone(pids[0]) and gone(pids[1]), timeout=30) and not gone(pids[2])
    cli("cancel", run_id, env=plugin_env, check_rc=0)
    assert wait_until(lambda: gone(pids[2]), timeout=30)
    assert json.loads(record.read_text())["state"] == "STOPPED"
