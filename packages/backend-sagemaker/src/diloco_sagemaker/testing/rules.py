"""What SageMaker refuses in a CreateTrainingJob beyond its model: the documented cross-field rules.

The model declares each member alone; AWS's documentation (CreateTrainingJob, StoppingCondition,
managed spot training, warm pools, tagging) ties members together. This is the stand-in's own
copy of those rules, kept apart from the launcher's (`diloco_sagemaker.servicerules`, which
`plan` checks) on purpose: were the two one function, a wrong rule would pass `plan` and the
stand-in alike, and no test would see it. Each rule reads the request and answers the
ValidationException message SageMaker gives (AWS does not publish the words verbatim; the
conditions are the documentation's).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

TWENTY_EIGHT_DAYS = 2_419_200  # StoppingCondition.MaxRuntimeInSeconds: "The maximum value is 28 days."

Rule = Callable[[dict[str, Any]], Iterator[str]]


def _image_jobs_say_where_and_how_long(req: dict[str, Any]) -> Iterator[str]:
    """A job that runs a training image (not serverless) needs its resources, a stopping
    condition and an algorithm; single-group resources name type, count and volume."""
    if req.get("ServerlessJobConfig"):
        return
    for member in ("ResourceConfig", "StoppingCondition", "AlgorithmSpecification"):
        if not req.get(member):
            yield f"{member} must be provided for a training job that runs a training image"
    resources = req.get("ResourceConfig") or {}
    if resources and not resources.get("InstanceGroups"):
        absent = [m for m in ("InstanceType", "InstanceCount", "VolumeSizeInGB") if resources.get(m) is None]
        if absent:
            yield "ResourceConfig must specify " + ", ".join(absent)


def _runtime_at_most_28_days(req: dict[str, Any]) -> Iterator[str]:
    runtime = (req.get("StoppingCondition") or {}).get("MaxRuntimeInSeconds")
    if runtime is not None and runtime > TWENTY_EIGHT_DAYS:
        yield (f"Invalid MaxRuntimeInSeconds: {runtime}. The maximum runtime of a training job is "
               f"{TWENTY_EIGHT_DAYS} seconds (28 days)")


def _spot_waits_at_least_its_runtime(req: dict[str, Any]) -> Iterator[str]:
    """MaxWaitTimeInSeconds is the whole budget of a managed spot job, waiting included; it exists
    only with spot, and spot instances cannot be kept warm."""
    stopping = req.get("StoppingCondition") or {}
    wait, runtime = stopping.get("MaxWaitTimeInSeconds"), stopping.get("MaxRuntimeInSeconds")
    if not req.get("EnableManagedSpotTraining"):
        if wait is not None:
            yield "MaxWaitTimeInSeconds is only supported when EnableManagedSpotTraining is true"
        return
    if wait is None:
        yield ("Invalid MaxWaitTimeInSeconds. It is required for managed spot training and must be greater than "
               "or equal to MaxRuntimeInSeconds")
    elif runtime is not None and wait < runtime:
        yield (f"Invalid MaxWaitTimeInSeconds: {wait}. It must be greater than or equal to MaxRuntimeInSeconds "
               f"({runtime})")
    if (req.get("ResourceConfig") or {}).get("KeepAlivePeriodInSeconds"):
        yield ("KeepAlivePeriodInSeconds is not supported for managed spot training: warm pools cannot be used "
               "with EnableManagedSpotTraining")


def _tags_are_unique_and_not_aws(req: dict[str, Any]) -> Iterator[str]:
    keys = Counter(tag.get("Key") for tag in req.get("Tags") or [])
    yield from (f"Duplicate tag key '{k}': tag keys must be unique"
                for k in sorted(k for k, n in keys.items() if n > 1))
    yield from (f"Tag key '{k}' uses the reserved prefix 'aws:'" for k in keys
                if isinstance(k, str) and k.lower().startswith("aws:"))


def _channels_are_unique(req: dict[str, Any]) -> Iterator[str]:
    names = Counter(channel.get("ChannelName") for channel in req.get("InputDataConfig") or [])
    yield from (f"Channel names must be unique; '{c}' is given more than once"
                for c in sorted(c for c, n in names.items() if n > 1))


CREATE_TRAINING_JOB: tuple[Rule, ...] = (_image_jobs_say_where_and_how_long, _runtime_at_most_28_days,
                                         _spot_waits_at_least_its_runtime, _tags_are_unique_and_not_aws,
                                         _channels_are_unique)


def broken(operation: str, req: dict[str, Any]) -> list[str]:
    """The message of every documented rule `req` breaks, in the order above (empty: none)."""
    rules = CREATE_TRAINING_JOB if operation == "CreateTrainingJob" else ()
    return [message for rule in rules for message in rule(req)]
