"""processes_per_replica: the spec, the one command builder, the rank contract, and backends that
cannot honour it (no torch here: the launcher side only; the replica side is tested in
diloco-replica and tests/test_process_groups.py)."""

from __future__ import annotations

import json
from importlib.util import find_spec

import pytest

from conftest import write_spec

from diloco.bootstrap.context import ReplicaContext
from diloco.errors import SpecError
from diloco.store.presence import incarnation
from diloco.inputs.replicaenv import parse_entrypoint, replica_env
from diloco.procgroup import gpu_count, replica_command, resolve_processes
from diloco.spec.runspec import parse_spec

OLD_PLUGIN = '''
from diloco import hookimpl
from diloco.local.executor import LocalProcessExecutor
from diloco.protocol import Capabilities

class OldExecutor(LocalProcessExecutor):
    """A third-party executor that starts one process per replica (declares no process_groups)."""
    backend_name = "old"
    capabilities = Capabilities(relaunches_one_rank=True, shares_launcher_filesystem=True)

@hookimpl
def diloco_register_executors():
    return [OldExecutor]
'''


def spec_of(**top):
    return parse_spec({"backend": "local", "replicas": 2, "entrypoint": "job:main", **top})


def test_processes_default_to_the_gpu_count_and_are_validated():
    assert spec_of().processes_per_replica == 1
    assert spec_of(gpu="H100").processes_per_replica == 1
    assert spec_of(gpu="H100:8").processes_per_replica == 8
    assert spec_of(gpu="H100:8", processes_per_replica=2).processes_per_replica == 2
    assert gpu_count("A10G:4") == 4 and gpu_count("A10G") is None and gpu_count("A10G:x") is None
    for bad in (0, 65, "2"):
        with pytest.raises(SpecError, match="processes_per_replica"):
            spec_of(processes_per_replica=bad)
    with pytest.raises(SpecError):
        resolve_processes(True, None)


def test_one_command_starts_a_replica_on_every_backend():
    assert replica_command(1) == ["python", "-m", "diloco.bootstrap.runner"]
    cmd = replica_command(4, python="/venv/bin/python")
    assert cmd[:3] == ["/venv/bin/python", "-m", "diloco_replica.torchrun"]
    assert cmd[cmd.index("--nproc-per-node") + 1] == "4" and cmd[cmd.index("--max-restarts") + 1] == "0"
    assert "--standalone" in cmd and cmd[-2:] == ["-m", "diloco.bootstrap.runner"]


def test_the_rank_contract_for_one_and_for_several_processes():
    common = dict(rank=1, n_replicas=4, run_id="r", attempt=0, entrypoint=parse_entrypoint("job:main"),
                  entrypoint_args={}, rendezvous="s3://b/p", timeout=None)
    one = replica_env(**common)
    # WORLD_SIZE is torch's: a one-process replica has none (accelerate would wait for a group of 4)
    assert one["REPLICA_RANK"] == "1" and one["DILOCO_REPLICAS"] == "4" and "WORLD_SIZE" not in one
    many = replica_env(**common, processes=8)
    assert many["REPLICA_RANK"] == "1" and many["DILOCO_REPLICAS"] == "4" and "WORLD_SIZE" not in many
    assert many["MALLOC_MMAP_THRESHOLD_"] == one["MALLOC_MMAP_THRESHOLD_"] == str(8 << 20)  # every replica
    assert replica_env(**common, processes=8, env={"MALLOC_MMAP_THRESHOLD_": "0"})["MALLOC_MMAP_THRESHOLD_"] == "0"
    # inside: torchrun's variables describe the replica's group; diloco's say which replica it is
    ctx = ReplicaContext.from_env({**many, "WORLD_SIZE": "8", "RANK": "3", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8"})
    assert (ctx.rank, ctx.world_size, ctx.lane, ctx.lanes) == (1, 4, 3, 8)
    alone = ReplicaContext.from_env({"REPLICA_RANK": "2", "WORLD_SIZE": "3"})  # torch's WORLD_SIZE is not the replicas
    assert (alone.rank, alone.world_size, alone.lane, alone.lanes) == (2, 1, 0, 1)


@pytest.mark.parametrize("env, expected", [
    ({}, incarnation(0)),
    ({"DILOCO_ATTEMPT": "2"}, incarnation(2)),
    ({"DILOCO_ATTEMPT": "2", "DILOCO_RERUN": "3"}, incarnation(2, 3)),   # Slurm's third requeue of attempt 2
    ({"DILOCO_RERUN": ""}, incarnation(0)),
])
def test_a_replica_knows_its_incarnation(env, expected):
    ctx = ReplicaContext.from_env({"REPLICA_RANK": "1", "DILOCO_REPLICAS": "2", **env})
    assert ctx.incarnation == expected


@pytest.mark.parametrize("value", ["-1", "x", "1.5", "1" * 12, "٣"])
def test_a_rerun_number_that_is_not_a_count_is_named(value):
    with pytest.raises(ValueError, match="DILOCO_RERUN"):
        ReplicaContext.from_env({"DILOCO_RERUN": value})


def test_local_dryrun_shows_torchrun_and_the_devices_each_replica_gets(cli, project):
    spec = write_spec(project, 'backend = { name = "local", devices = [0, 1, 2, 3] }\nreplicas = 2\n'
                               'processes_per_replica = 2\nentrypoint = "job:main"\n')
    proc = cli("dryrun", str(spec))
    if find_spec("torch") is None or find_spec("diloco_replica") is None:  # diloco-core alone: say what is missing
        assert proc.returncode == 2 and "pip install diloco-replica" in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
        return
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    first, second = plan["processes"]
    assert first["argv"][1:3] == ["-m", "diloco_replica.torchrun"]
    assert first["argv"][first["argv"].index("--nproc-per-node") + 1] == "2"
    assert first["env"]["CUDA_VISIBLE_DEVICES"] == "0,1" and second["env"]["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert first["env"]["DILOCO_REPLICAS"] == "2" and "WORLD_SIZE" not in first["env"]


def test_a_backend_that_cannot_start_several_processes_says_so_at_dryrun(cli, project, state_dir):
    (project / "old_plugin.py").write_text(OLD_PLUGIN)
    env = {"DILOCO_PLUGINS": "old_plugin", "PYTHONPATH": str(project)}
    spec = write_spec(project, 'backend = "old"\nreplicas = 2\nentrypoint = "job:main"\n'
                               'rendezvous = "s3://bucket/runs"\nprocesses_per_replica = 2\n')
    for cmd in ("dryrun", "run"):
        proc = cli(cmd, str(spec), env=env)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "backend 'old' cannot start several processes per replica" in lines[0]
    assert not (state_dir / "runs").exists() or not any((state_dir / "runs").iterdir())
    single = write_spec(project, 'backend = "old"\nreplicas = 2\nentrypoint = "job:main"\n'
                                 'rendezvous = "s3://bucket/runs"\n')
    assert cli("dryrun", str(single), env=env).returncode == 0  # L = 1 needs nothing new from a backend
