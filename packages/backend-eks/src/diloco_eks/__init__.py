"""diloco-backend-eks: run diloco replicas as Kubernetes Indexed Jobs (EKS or any cluster ≥ 1.29)."""

from .executor import EksExecutor
from .options import EksOptions

__all__ = ["EksExecutor", "EksOptions"]
