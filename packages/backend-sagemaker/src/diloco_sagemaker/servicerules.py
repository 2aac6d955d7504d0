"""What SageMaker refuses in a CreateTrainingJob request beyond its model's constraints.

The service model (`servicemodel`) declares each member alone; these rules tie members
together or bound them where the model does not, as AWS's documentation states them
(CreateTrainingJob, StoppingCondition, managed spot training, warm pools, tagging):

- `EnableManagedSpotTraining` needs `StoppingCondition.MaxWaitTimeInSeconds`, at least
  `MaxRuntimeInSeconds` (the whole spot budget, waiting included); without spot it is refused;
- spot and a warm pool (`ResourceConfig.KeepAlivePeriodInSeconds` > 0) do not go together;
- `MaxRuntimeInSeconds` is at most 28 days;
- a job with a training image needs `ResourceConfig` (type, count, volume) and a `StoppingCondition`;
- tag keys are unique and never start with `aws:`; channel names are unique.

Each rule answers one ValidationException message, worded like the service's (AWS does not
publish them verbatim; the conditions are what the documentation states). `plan` checks these;
the test control plane keeps its own copy (`diloco_sagemaker.testing.rules`), so that a wrong
rule here is refused there rather than agreed with.
"""

from __future__ import annotations

from typing import Any

MAX_RUNTIME_SECONDS = 28 * 24 * 3600


def create_training_job(req: dict[str, Any]) -> list[str]:
    """The documented cross-field rules `req` breaks (empty: SageMaker accepts it)."""
    out: list[str] = []
    stopping = req.get("StoppingCondition") or {}
    resources = req.get("ResourceConfig") or {}
    runtime, wait = stopping.get("MaxRuntimeInSeconds"), stopping.get("MaxWaitTimeInSeconds")
    if not req.get("ServerlessJobConfig"):
        for name in ("ResourceConfig", "StoppingCondition", "AlgorithmSpecification"):
            if not req.get(name):
                out.append(f"{name} must be provided for a training job that runs a training image")
        if resources and not resources.get("InstanceGroups"):
            missing = [k for k in ("InstanceType", "InstanceCount", "VolumeSizeInGB") if resources.get(k) is None]
            if missing:
                out.append(f"ResourceConfig must specify {', '.join(missing)}")
    if runtime is not None and runtime > MAX_RUNTIME_SECONDS:
        out.append(f"Invalid MaxRuntimeInSeconds: {runtime}. The maximum runtime of a training job is "
                   f"{MAX_RUNTIME_SECONDS} seconds (28 days)")
    if req.get("EnableManagedSpotTraining"):
        if wait is None:
            out.append("Invalid MaxWaitTimeInSeconds. It is required for managed spot training and must be "
                       "greater than or equal to MaxRuntimeInSeconds")
        elif runtime is not None and wait < runtime:
            out.append(f"Invalid MaxWaitTimeInSeconds: {wait}. It must be greater than or equal to "
                       f"MaxRuntimeInSeconds ({runtime})")
        if resources.get("KeepAlivePeriodInSeconds"):
            out.append("KeepAlivePeriodInSeconds is not supported for managed spot training: warm pools cannot be "
                       "used with EnableManagedSpotTraining")
    elif wait is not None:
        out.append("MaxWaitTimeInSeconds is only supported when EnableManagedSpotTraining is true")
    keys = [t.get("Key") for t in req.get("Tags") or []]
    for key in sorted({k for k in keys if keys.count(k) > 1}):
        out.append(f"Duplicate tag key '{key}': tag keys must be unique")
    for key in keys:
        if isinstance(key, str) and key.lower().startswith("aws:"):
            out.append(f"Tag key '{key}' uses the reserved prefix 'aws:'")
    channels = [c.get("ChannelName") for c in req.get("InputDataConfig") or []]
    for name in sorted({c for c in channels if channels.count(c) > 1}):
        out.append(f"Channel names must be unique; '{name}' is given more than once")
    return out
