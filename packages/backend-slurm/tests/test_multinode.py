"""A replica of several nodes as one Slurm job (`diloco_slurm.multinode`): the script the plan
builds, what it refuses, and the script's own logic run in bash with srun and scontrol stood in
for. The real thing, on a cluster of two nodes (two slurmd on this machine), is
tests/test_slurm_e2e.py's: a replica of two nodes trains, loses a node, is relaunched once and
rejoins bit-identical (one test there, as each start of torch on two nodes costs seconds)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from diloco.errors import UserError
from diloco.procgroup import node_env
from conftest import wait_for
from diloco.testing import REPORT, plan_for, request_for, wait_for_status
from diloco_slurm import SlurmExecutor
from diloco_slurm import batchscript, limits
from diloco_slurm.access import ClusterAccess
from diloco_slurm.testing import SlurmCluster, slurm_installed

ROOT = Path(__file__).resolve().parents[3]


def script_of(executor, rank: int = 0, **fields) -> str:
    plan = plan_for(executor, 2, REPORT, {"marker": "m"}, run_id="run-1", **fields)
    return "\n".join(plan.body["jobs"][rank]["script"]) + "\n"


def test_a_replica_of_two_nodes_is_one_job_of_two_nodes_one_torchrun_agent_on_each():
    script = script_of(SlurmExecutor(state_dir="/shared/d", partition="gpu"), gpu="H100:8", processes_per_replica=8,
                       nodes=2)
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --cpus-per-task=32", "# diloco run run-1, rank 0, attempt 0, 2 nodes",
                 'first_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)  # where this batch shell runs'):
        assert line + "\n" in script, line
    assert "#SBATCH --ntasks=1\n" not in script
    srun = next(x for x in script.splitlines() if x.startswith("set -- srun "))
    assert srun.startswith("set -- srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 --mem=0 --cpus-per-task=32 "
                           "bash -c ")
    assert srun.endswith(' node "$stem" "$@"')
    assert "--nnodes 2 --nproc-per-node 8 --rdzv-backend static" in script
    # every variable node_env names, with Slurm's values: the node's rank, the first node, a port per job
    assert set(re.findall(r"\bPET_[A-Z_]+(?==)", script)) == set(node_env(0, "a", 1))
    assert 'PET_NODE_RANK="$node"' in srun and "node=$SLURM_NODEID" in srun
    assert "PET_MASTER_PORT=$((20000 + SLURM_JOB_ID % 10000))" in script
    assert script.index("set -- srun") < script.index('"$@" &') < script.index('echo "$code" > "$stem.exit"')


def test_a_replica_of_one_node_is_the_job_it_always_was():
    script = script_of(SlurmExecutor(state_dir="/s"), gpu="H100:8", processes_per_replica=8)
    assert "#SBATCH --nodes=1\n#SBATCH --ntasks=1\n" in script
    assert "srun" not in script and "PET_" not in script and "--standalone" in script


@pytest.mark.parametrize("fields, max_nodes, words", [
    ({"nodes": 4}, 2, "nodes = 4 is more than partition 'gpu' gives one job (2)"),
    ({"nodes": 2, "gpu": "H100:4", "processes_per_replica": 8}, None, "processes_per_replica = 8 is per node"),
])
def test_what_slurm_could_not_run_is_refused_in_one_line(fields, max_nodes, words):
    options = SlurmExecutor(state_dir="/s", partition="gpu").options
    request = request_for(1, REPORT, **fields)
    with pytest.raises(UserError) as info:
        batchscript.batch_jobs(options, ClusterAccess(options), request, default_state_dir="/s",
                               default_python="python3", max_nodes=max_nodes)
    assert words in str(info.value) and "\n" not in str(info.value)


PARTITIONS = ("PartitionName=debug Default=YES MaxNodes=UNLIMITED MaxTime=UNLIMITED TotalNodes=2\n"
              "PartitionName=gpu Default=NO MaxNodes=8 MaxTime=1-00:00:00 TotalNodes=64\n"
              "PartitionName=odd Default=NO MaxNodes=UNLIMITED TotalNodes=x\n")


@pytest.mark.parametrize("partition, nodes", [(None, 2), ("gpu", 8), ("odd", None), ("gone", None)])
def test_the_partitions_node_limit_is_read_from_scontrol(partition, nodes):
    assert limits.max_nodes(PARTITIONS, partition) == nodes


# srun and scontrol stood in for: the node command once per node (SLURM_NODEID set), and the
# step ended (SIGTERM to every task's processes) when one fails, as --kill-on-bad-exit does.
FAKE_SRUN = r'''#!/bin/bash
set -m  # each node its own process group, as each task is Slurm's to signal whole
nodes=1
while [ "${1#-}" != "$1" ]; do case $1 in --nodes=*) nodes=${1#--nodes=} ;; esac; shift; done
pids=()
for ((r = 0; r < nodes; r++)); do SLURM_NODEID=$r "$@" & pids+=($!); done
code=0
for ((i = 0; i < nodes; i++)); do
  wait -n; c=$?
  if [ "$c" -ne 0 ] && [ "$code" -eq 0 ]; then code=$c; kill -TERM -- "${pids[@]/#/-}" 2>/dev/null; fi
done
exit "$code"
'''
FAKE_SCONTROL = r'''#!/bin/bash
case "$*" in
  "show hostnames "*) echo n7; echo n8 ;;
  "show node -o n7") echo "NodeName=n7 Arch=x86_64 NodeAddr=10.1.2.7 NodeHostName=n7 Port=0" ;;
esac
'''
# Each node's stand-in for the torchrun agent: it notes what it was given, then as the test says.
NODE = r'''echo "$PET_NODE_RANK $PET_MASTER_ADDR $PET_MASTER_PORT" > "$DILOCO_RESULT_PATH.seen"
case "$PET_NODE_RANK:$BEHAVIOUR" in
  *:ok) echo "{\"status\": \"succeeded\", \"exit_code\": 0, \"node\": $PET_NODE_RANK}" > "$DILOCO_RESULT_PATH" ;;
  1:error) sleep 0.2; echo '{"status": "failed", "exit_code": 78, "error": "bad spec (process 1 of 2 (node 1))"}' \
    > "$DILOCO_RESULT_PATH"; exit 78 ;;
  1:killed) sleep 0.2; kill -KILL $$ ;;
  *) sleep 30 ;;
esac
'''


@pytest.mark.parametrize("behaviour, code, result", [
    ("ok", 0, {"status": "succeeded", "exit_code": 0, "node": 0}),  # node 0's result is the replica's
    ("error", 78, {"status": "failed", "exit_code": 78, "error": "bad spec (process 1 of 2 (node 1))"}),
    ("killed", 137, {"rank": 1, "attempt": 3, "status": "failed", "exit_code": 137,
                     "error": "node 1 of 2 killed by SIGKILL (its torchrun agent reported no result); Slurm "
                              "stopped the replica's other nodes"}),
])
def test_the_script_gives_each_node_its_place_and_the_replica_one_result(tmp_path, behaviour, code, result):
    """The plan's script in bash, the node command swapped for NODE: node 0's result on success;
    the failed node's own result, or a line naming it, and its exit code, when one fails."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    plan = plan_for(SlurmExecutor(state_dir=str(tmp_path)), 2, REPORT, {}, run_id="run-1", nodes=2, attempt=3)
    lines = plan.body["jobs"][1]["script"]
    (tmp_path / "node.sh").write_text(NODE)
    lines = [f"set -- bash {tmp_path}/node.sh" if x.startswith("set -- ") and "torchrun" in x else x for x in lines]
    stem = tmp_path / "slurm" / "run-1" / "rank-1.attempt-3"
    stem.parent.mkdir(parents=True)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "123456",
           "SLURM_JOB_NODELIST": "n[7-8]", "BEHAVIOUR": behaviour}
    proc = subprocess.run(["bash", "-c", "\n".join(lines)], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert Path(f"{stem}.exit").read_text().strip() == str(code)
    assert json.loads(Path(f"{stem}.result.json").read_text()) == result
    assert [Path(f"{stem}.node-{r}.result.json.seen").read_text().split() for r in (0, 1)] == \
        [[str(r), "10.1.2.7", str(20000 + 123456 % 10000)] for r in (0, 1)]
    assert (Path(f"{stem}.first-failed-node").read_text().strip() if code else None) == ("1" if code else None)


def test_the_walkthroughs_two_node_replica_dry_runs_as_the_page_says(tmp_path):
    page = (ROOT / "docs" / "walkthroughs" / "slurm-university.md").read_text()
    text = re.search(r"```toml two-nodes\n(.*?)```", page, re.S).group(1)
    spec = tmp_path / "diloco.toml"
    spec.write_text(text.replace('entrypoint = "tiny_lm:train"',
                                 f'entrypoint = "tiny_lm:train"\nworkdir = "{ROOT / "examples" / "tiny-lm"}"'))
    env = {**os.environ, "DILOCO_STATE_DIR": str(tmp_path / "state"), "DILOCO_PLUGINS": "diloco_slurm.plugin"}
    proc = subprocess.run([sys.executable, "-m", "diloco", "dryrun", str(spec)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for words in ('"#SBATCH --nodes=2"', '"#SBATCH --ntasks-per-node=1"', '"#SBATCH --gpus-per-node=4"',
                  "srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1", "--nnodes 2 --nproc-per-node 4"):
        assert words in proc.stdout, words
    spec.write_text(spec.read_text().replace("nodes = 2", "nodes = 2\nprocesses_per_replica = 8"))
    bad = subprocess.run([sys.executable, "-m", "diloco", "dryrun", str(spec)], capture_output=True, text=True,
                         env=env, timeout=120)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and "per node" in bad.stderr, bad.stderr


# -- the script on a real cluster of two nodes, the node command stood in for --------------------

STAND_IN = r'''echo "node $PET_NODE_RANK on $SLURMD_NODENAME, store $PET_MASTER_ADDR:$PET_MASTER_PORT"
exec sleep 300
'''


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    if not slurm_installed():
        pytest.fail("Slurm is not installed: apt-get install slurmctld slurmd slurm-client (.ci/run does it)")
    with SlurmCluster(tmp_path_factory.mktemp("slurm-two"), "two", nodes=2, cpus=2, memory_mb=2048) as cluster:
        yield cluster


def stand_in_node(executor, tmp_path: Path, **fields):
    """Submit a two-node replica whose node command (torchrun) is swapped for STAND_IN: Slurm's
    side of the script (srun, node ranks, results, exit codes) runs for real, without torch."""
    (tmp_path / "stand_in.sh").write_text(STAND_IN)
    plan = plan_for(executor, 1, REPORT, {}, nodes=2, **fields)
    for job in plan.body["jobs"]:
        job["script"] = [f"set -- bash {tmp_path}/stand_in.sh" if x.startswith("set -- ") and "torchrun" in x
                         else x for x in job["script"]]
    (handle,) = executor.submit(plan)
    return handle


def stand_in_of(stem: str, node: int) -> int | None:
    """The pid of node `node`'s stand-in (its environment names the node's own result file)."""
    mine = f"DILOCO_RESULT_PATH={stem}.node-{node}.result.json\0".encode()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd, env = (Path(f"/proc/{entry}/{x}").read_bytes() for x in ("cmdline", "environ"))
        except OSError:
            continue
        if (b"stand_in.sh" in cmd or cmd.startswith(b"sleep\0")) and mine in env:
            return int(entry)
    return None


def test_a_node_slurm_loses_requeues_the_whole_two_node_job_under_its_id(two_nodes, tmp_path):
    """NODE_FAIL on a real cluster of two nodes: node 2 set DOWN under a running two-node replica;
    Slurm ends the job on both nodes and requeues it whole (same job id, Restarts 1), which reads
    pending with the requeue named: no relaunch, no budget spent, the next run a new incarnation.
    (A node's task killed, the other case, is tests/test_slurm_e2e.py's, with torch.)"""
    executor = SlurmExecutor(slurm_conf=str(two_nodes.conf), state_dir=str(tmp_path))
    refused = pytest.raises(UserError, plan_for, executor, 1, REPORT, nodes=3).value
    assert "nodes = 3 is more than the cluster's default partition gives one job (2)" in str(refused)
    handle = stand_in_node(executor, tmp_path)
    stem = handle.metadata["stem"]
    assert wait_for(lambda: stand_in_of(stem, 0) and stand_in_of(stem, 1), timeout=60), executor.stream_logs(handle)
    subprocess.run(["scontrol", "update", "NodeName=n2", "State=DOWN", "Reason=lost"], env=two_nodes.env, check=True,
                   capture_output=True)
    try:
        assert wait_for_status(executor, handle, {"pending"}, timeout=60) == "pending"
        assert "requeued (restart 1)" in executor.status_detail(handle) and executor.reruns(handle) == 1
        assert wait_for(lambda: stand_in_of(stem, 0) is None and stand_in_of(stem, 1) is None, timeout=30)
        log = executor.stream_logs(handle)
        assert "node 0 on n1, store 127.0.0.1:" in log and "node 1 on n2, store 127.0.0.1:" in log, log
        assert "DUE TO NODE FAILURE" in log, log
    finally:  # (ReturnToService=2 may have brought it back already: then RESUME is refused, and not needed)
        subprocess.run(["scontrol", "update", "NodeName=n2", "State=RESUME"], env=two_nodes.env, capture_output=True)
        executor.cancel(handle)
