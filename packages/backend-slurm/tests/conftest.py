"""A real one-node Slurm cluster per test session (diloco_slurm.testing.cluster), and executors on it."""

from __future__ import annotations

import os
import shlex
import sys
import time

import pytest

from diloco_slurm import SlurmExecutor
from diloco_slurm.testing import ALIAS, LoopbackSshd, SlurmCluster, slurm_installed, sshd_installed


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    if not slurm_installed():
        pytest.fail("Slurm is not installed: apt-get install slurmctld slurmd slurm-client (.ci/run does it)")
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm-alpha"), "alpha")
    cluster.start()
    print(f"\nSlurm cluster {cluster.name} up in {cluster.up_seconds:.2f}s, first job running after "
          f"{cluster.first_job_seconds:.2f}s more")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def sshd(tmp_path_factory):
    """A real sshd on 127.0.0.1 with a key made for the test; `ssh_config` names it as Host ALIAS."""
    if not sshd_installed():
        pytest.fail("OpenSSH is not installed: apt-get install openssh-server openssh-client (.ci/run does it)")
    with LoopbackSshd(tmp_path_factory.mktemp("sshd")) as server:
        yield server


def over_ssh(sshd, cluster, state_dir) -> dict:
    """The [backend] options of a cluster reached over ssh: what a user writes, plus the test's own code
    path (a user's `setup` would activate their environment there instead)."""
    setup = [f"export PYTHONPATH={shlex.quote(os.environ['PYTHONPATH'])}"] if os.environ.get("PYTHONPATH") else []
    return {"host": ALIAS, "ssh_config": str(sshd.ssh_config), "slurm_conf": str(cluster.conf),
            "state_dir": str(state_dir), "python": sys.executable, "setup": setup}


@pytest.fixture
def slurm(slurm_cluster, tmp_path):
    """An executor on the test cluster, its run directories under this test's tmp_path."""
    def make(**options):
        return SlurmExecutor(slurm_conf=str(slurm_cluster.conf), state_dir=str(tmp_path), **options)
    return make


def wait_for(predicate, timeout: float = 60.0, interval: float = 0.2):
    """Poll `predicate` until it returns something truthy (returned) or `timeout` passes (its last value)."""
    deadline = time.monotonic() + timeout
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(interval)
        value = predicate()
    return value
