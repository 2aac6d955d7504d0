"""The conformance kit against a real Slurm cluster (slurmctld + slurmd started by the fixture)."""

from __future__ import annotations

import pytest

from diloco.testing import ExecutorConformance
from conftest import over_ssh
from diloco_slurm import SlurmExecutor


class TestSlurmConformance(ExecutorConformance):
    wait_timeout = 90.0

    @pytest.fixture(autouse=True)
    def _cluster(self, slurm_cluster, tmp_path):
        self.conf, self.root = slurm_cluster.conf, tmp_path

    def make_executor(self):  # a second instance stands for another process
        return SlurmExecutor(slurm_conf=str(self.conf), state_dir=str(self.root))


class TestSlurmOverSshConformance(ExecutorConformance):
    """The same kit with every Slurm command and file read going through ssh to a real sshd (two
    replicas where the kit launches several: the paths are the same, the suite shorter)."""

    n_replicas = 2
    wait_timeout = 90.0

    @pytest.fixture(autouse=True)
    def _cluster(self, slurm_cluster, sshd, tmp_path):
        self.options = over_ssh(sshd, slurm_cluster, tmp_path)

    def make_executor(self):
        return SlurmExecutor(**self.options)
