"""The conformance kit against a real Slurm cluster (slurmctld + slurmd started by the fixture)."""

from __future__ import annotations

import pytest

from diloco.testing import ExecutorConformance
from diloco_slurm import SlurmExecutor


class TestSlurmConformance(ExecutorConformance):
    wait_timeout = 90.0

    @pytest.fixture(autouse=True)
    def _cluster(self, slurm_cluster, tmp_path):
        self.conf, self.root = slurm_cluster.conf, tmp_path

    def make_executor(self):  # a second instance stands for another process
        return SlurmExecutor(slurm_conf=str(self.conf), state_dir=str(self.root))
