"""The batch script and sbatch command `plan` builds (what `diloco dryrun` prints and `submit` sends),
and the [backend] options it refuses: no Slurm needed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from diloco.errors import UserError
from diloco.testing import REPORT, plan_for
from diloco_slurm import SlurmExecutor, limits


def one_job(executor, **fields):
    return plan_for(executor, 2, REPORT, {"marker": "m"}, run_id="run-1", **fields).body["jobs"][0]


def test_a_gpu_replica_is_one_node_with_its_gpus_and_torchrun_over_them():
    job = one_job(SlurmExecutor(state_dir="/shared/diloco", partition="gpu", gres_type="h100", cpus=64,
                                memory="512G", time_limit=600), gpu="H100:8", processes_per_replica=8)
    script = "\n".join(job["script"]) + "\n"
    for line in ("#SBATCH --job-name=diloco-run-1-r0-a0", "#SBATCH --output=/shared/diloco/slurm/run-1/rank-0.attempt-0.log",
                 "#SBATCH --nodes=1", "#SBATCH --ntasks=1", "#SBATCH --time=600", "#SBATCH --signal=B:USR1@120",
                 "#SBATCH --requeue", "#SBATCH --partition=gpu", "#SBATCH --cpus-per-task=64", "#SBATCH --mem=512G",
                 "#SBATCH --gpus-per-node=h100:8"):
        assert line + "\n" in script, line
    assert "--nproc-per-node 8" in script and "export DILOCO_PREEMPTION_SIGNAL=SIGUSR1" in script
    assert job["command"] == ["sbatch", "--parsable"]


@pytest.mark.parametrize("gpu, processes, cpus, line", [
    ("H100:8", 8, None, "#SBATCH --cpus-per-task=32"),   # 4 per GPU, not the partition's (often 1)
    ("H100:1", 1, None, "#SBATCH --cpus-per-task=4"),
    ("H100", 8, None, "#SBATCH --cpus-per-task=9"),      # at least one per process, and one more
    ("H100:8", 8, 96, "#SBATCH --cpus-per-task=96"),     # `cpus` sets it outright
    (None, 1, None, None),                               # no GPU: the partition's default
    (None, 1, 6, "#SBATCH --cpus-per-task=6"),
])
def test_a_jobs_cpus_follow_its_gpus_unless_set(gpu, processes, cpus, line):
    job = one_job(SlurmExecutor(state_dir="/s", cpus=cpus), gpu=gpu, processes_per_replica=processes)
    got = [x for x in job["script"] if x.startswith("#SBATCH --cpus-per-task")]
    assert got == ([line] if line else [])


def test_the_default_time_limit_leaves_room_for_the_replicas_own_timeout_and_the_notice():
    script = one_job(SlurmExecutor(state_dir="/s"), timeout=3600)["script"]
    script = "\n".join(script) + "\n"
    assert "#SBATCH --time=63\n" in script  # 3600 s + 120 s notice + a minute, in minutes


@pytest.mark.parametrize("text, minutes", [
    ("30", 30), ("30:59", 30), ("2:00:00", 120), ("00:02:00", 2), ("1-00:00:00", 1440), ("2-12", 3600),
    ("1-01:30", 1530), ("UNLIMITED", None), ("INFINITE", None), ("", None), ("soon", None), ("1:2:3:4", None),
])
def test_slurm_times_read_in_whole_minutes(text, minutes):
    assert limits.parse_minutes(text) == minutes


PARTITIONS = ("PartitionName=debug AllowGroups=ALL Default=YES MaxTime=UNLIMITED State=UP\n"
              "PartitionName=short AllowGroups=ALL Default=NO MaxTime=00:02:00 State=UP\n"
              "PartitionName=day Default=NO MaxTime=1-00:00:00 State=UP\n")


@pytest.mark.parametrize("partition, minutes", [(None, None), ("short", 2), ("day", 1440), ("gone", None)])
def test_the_partitions_max_time_is_read_from_scontrol(partition, minutes):
    assert limits.max_time_minutes(PARTITIONS, partition) == minutes


@pytest.mark.parametrize("asked, timeout, max_minutes, minutes, clamped", [
    (None, 3600, None, 63, False),      # the spec's timeout + 120 s notice + a minute
    (None, 3600, 1440, 63, False),
    (None, 86_400, 1440, 1440, True),   # a day's timeout on a day's partition: clamped, said so
    (None, 3600, 2, 2, True),
    (30, 3600, 30, 30, False),          # asked for: as given, up to the maximum
    (30, 3600, None, 30, False),
])
def test_the_time_limit_stays_inside_the_partitions_max_time(asked, timeout, max_minutes, minutes, clamped):
    got = limits.time_limit(asked, timeout, 120, max_minutes, "p")
    assert got.minutes == minutes and (got.note is not None) is clamped
    if clamped:
        assert f"clamped to {minutes} minutes, the MaxTime of partition 'p'" in got.note


def test_a_time_limit_asked_over_the_partitions_max_time_is_one_line():
    with pytest.raises(UserError) as info:
        limits.time_limit(60, 3600, 120, 2, "short")
    assert "over the MaxTime of partition 'short' (2 minutes)" in str(info.value) and "\n" not in str(info.value)


def test_values_are_quoted_and_secrets_stay_out_of_the_script():
    executor = SlurmExecutor(state_dir="/s", setup=["module load cuda/12.4"])
    plan = plan_for(executor, 1, REPORT, {}, run_id="run-1", env={"PLAIN": "$(touch /tmp/pwned) 'x'"},
                    secret_env={"HF_TOKEN": "hf-secret-value-123"})
    rendered = plan.render()
    assert "hf-secret-value-123" not in rendered
    script = "\n".join(plan.body["jobs"][0]["script"])
    assert "export PLAIN=''\"'\"'" not in script and "export PLAIN='$(touch /tmp/pwned) '\"'\"'x'\"'\"''" in script
    assert "set -a; . /s/slurm/run-1/secrets.env; set +a" in script
    assert plan.body["secrets_file"] == {"path": "/s/slurm/run-1/secrets.env", "names": ["HF_TOKEN"]}
    assert script.index("module load cuda/12.4") < script.index("export DILOCO_RUN_ID")


def test_the_script_runs_in_bash_and_means_what_it_says(tmp_path):
    """The plan's script, given to bash with the replica swapped for `true`: it parses and records exit 0."""
    script = "\n".join(one_job(SlurmExecutor(state_dir=str(tmp_path)))["script"])
    script = script.replace("set -- ", "set -- true #", 1)
    stem = tmp_path / "slurm" / "run-1" / "rank-0.attempt-0"
    stem.parent.mkdir(parents=True)
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env={**os.environ, "SLURM_JOB_ID": "1"})
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "slurm" / "run-1" / "rank-0.attempt-0.exit").read_text().strip() == "0"


def test_over_ssh_every_command_is_the_users_own_ssh():
    executor = SlurmExecutor(host="me@login.example.edu", state_dir="/home/me/diloco", slurm_conf="/etc/slurm-b/slurm.conf",
                             ssh_config="/home/me/.ssh/diloco_config", cluster="gpu2")
    job = one_job(executor)
    command = job["command"]
    assert command[:5] == ["ssh", "-F", "/home/me/.ssh/diloco_config", "-o", "BatchMode=yes"]
    assert "ControlMaster=auto" in command  # one shared connection, the user's own ssh
    assert command[-3:] == ["--", "me@login.example.edu",
                            "env SLURM_CONF=/etc/slurm-b/slurm.conf sbatch -M gpu2 --parsable"]
    script = "\n".join(job["script"])
    assert "#SBATCH --chdir" not in script and "python3 -m diloco.bootstrap.runner" in script
    assert not executor.capabilities.shares_launcher_filesystem and not executor.capabilities.log_files
    assert SlurmExecutor().capabilities.shares_launcher_filesystem


@pytest.mark.parametrize("options, words", [
    ({"partition": "gpu; rm -rf /"}, "backend.partition"),
    ({"account": "-x"}, "backend.account"),
    ({"sbatch_options": ["--output=/tmp/x"]}, "not an allowed #SBATCH option"),
    ({"sbatch_options": ["--exclusive\n#SBATCH --output=/x"]}, "not an allowed #SBATCH option"),
    ({"setup": ["module load a\nrm -rf ~"]}, "newlines"),
    ({"host": "-oProxyCommand=touch /tmp/x"}, "backend.host"),
    ({"state_dir": "relative/dir"}, "absolute path"),
    ({"memory": "lots"}, "backend.memory"),
    ({"time_limit": 10**9}, "backend.time_limit"),
    ({"preemption_signal": "SIGTERM"}, "backend.preemption_signal"),
])
def test_bad_options_are_one_line_naming_the_key(options, words):
    with pytest.raises(UserError) as info:
        SlurmExecutor(**options)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_a_remote_cluster_needs_a_state_dir_there():
    with pytest.raises(UserError, match="state_dir is needed with host"):
        one_job(SlurmExecutor(host="me@login"))


def test_diloco_dryrun_prints_the_exact_script_and_command(tmp_path):
    (tmp_path / "job.py").write_text("def train(ctx):\n    return ctx.rank\n")
    spec = tmp_path / "diloco.toml"
    spec.write_text(f'entrypoint = "job:train"\nreplicas = 2\ngpu = "H100:8"\n[backend]\nname = "slurm"\n'
                    f'partition = "gpu"\nstate_dir = "{tmp_path}/runs"\n')
    env = {**os.environ, "DILOCO_STATE_DIR": str(tmp_path / "state"), "DILOCO_PLUGINS": "diloco_slurm.plugin"}
    proc = subprocess.run([sys.executable, "-m", "diloco", "dryrun", str(spec)], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert '"command": [\n        "sbatch",\n        "--parsable"\n      ]' in proc.stdout
    assert '"#SBATCH --partition=gpu",' in proc.stdout and '"#SBATCH --gpus-per-node=8",' in proc.stdout
    spec.write_text(spec.read_text().replace('partition = "gpu"', 'partition = "a b"'))
    bad = subprocess.run([sys.executable, "-m", "diloco", "dryrun", str(spec)], capture_output=True, text=True, env=env)
    assert bad.returncode != 0 and "backend.partition" in bad.stderr and "Traceback" not in bad.stderr


def dryrun(tmp_path, spec_text):
    (tmp_path / "job.py").write_text("def train(ctx):\n    return ctx.rank\n")
    spec = tmp_path / "diloco.toml"
    spec.write_text(spec_text)
    env = {**os.environ, "DILOCO_STATE_DIR": str(tmp_path / "state"), "DILOCO_PLUGINS": "diloco_slurm.plugin"}
    env.pop("DILOCO_RENDEZVOUS", None)
    return subprocess.run([sys.executable, "-m", "diloco", "dryrun", str(spec)], capture_output=True, text=True, env=env)


GROUPS = """entrypoint = "job:train"
rendezvous = "file://{store}"
[[group]]
name = "here"
replicas = 1
backend = "local"
[[group]]
name = "cluster"
replicas = 2
[group.backend]
name = "slurm"
state_dir = "{store}"
{extra}
"""


def test_a_file_rendezvous_is_valid_when_every_rank_sees_the_launchers_filesystem(tmp_path):
    """Without `host` the launcher runs on the cluster (a login node): its shared filesystem is the replicas'."""
    proc = dryrun(tmp_path, GROUPS.format(store=tmp_path / "store", extra=""))
    assert proc.returncode == 0, proc.stderr


def test_a_file_rendezvous_is_refused_when_any_group_is_a_cluster_reached_over_ssh(tmp_path):
    proc = dryrun(tmp_path, GROUPS.format(store=tmp_path / "store", extra='host = "me@login.example.edu"'))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "do not see" in proc.stderr and "group 'cluster'" in proc.stderr, proc.stderr


def test_an_unreachable_login_host_fails_a_launch_in_one_line_and_never_a_poll(tmp_path):
    from diloco.protocol import ReplicaHandle
    from diloco.testing import launch
    from diloco_slurm.testing.cluster import free_port

    config = tmp_path / "ssh_config"  # a port nothing listens on
    config.write_text(f"Host nowhere\n  HostName 127.0.0.1\n  Port {free_port()}\n  StrictHostKeyChecking yes\n"
                      f"  UserKnownHostsFile {tmp_path}/known_hosts\n")
    executor = SlurmExecutor(host="nowhere", ssh_config=str(config), state_dir="/tmp/diloco-test")
    with pytest.raises(UserError) as info:
        launch(executor, 1, REPORT)
    assert str(info.value).startswith("cannot reach nowhere over ssh:") and "\n" not in str(info.value)
    handle = ReplicaHandle(0, "slurm", {"run_id": "r", "attempt": 0, "job_id": "12", "stem": "/tmp/diloco-test/x"})
    assert executor.poll(handle) == "pending"  # no answer: the status last read (none yet) stands
    assert "did not answer" in executor.status_detail(handle)
