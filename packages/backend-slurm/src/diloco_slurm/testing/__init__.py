"""Test helpers: a real Slurm cluster of one node or several (`SlurmCluster`) and a real sshd on 127.0.0.1 (`LoopbackSshd`)."""

from .cluster import SlurmCluster, job_processes, node_agent, slurm_installed
from .sshd import ALIAS, LoopbackSshd, sshd_installed

__all__ = ["ALIAS", "LoopbackSshd", "SlurmCluster", "job_processes", "node_agent", "slurm_installed", "sshd_installed"]
