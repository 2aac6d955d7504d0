"""diloco-backend-sagemaker: each DiLoCo replica is one SageMaker training job (managed spot, warm pools)."""

__version__ = "0.2.0"
