"""diloco-backend-slurm: each DiLoCo replica attempt is one Slurm batch job, here or over ssh."""

from .executor import SlurmExecutor
from .options import SlurmOptions

__all__ = ["SlurmExecutor", "SlurmOptions"]
