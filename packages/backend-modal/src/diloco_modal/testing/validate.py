"""What the fake Modal server refuses, as Modal's service does: checked on the request the real
client built, so a value the client passes through unchecked (a GPU name, a timeout, a region)
is refused here and not silently accepted.

Each check raises `GRPCError` with the status the client maps to the right exception
(INVALID_ARGUMENT → `modal.exception.InvalidError`, NOT_FOUND → `NotFoundError`,
RESOURCE_EXHAUSTED → `ResourceExhaustedError`) and, where Modal's wording is known, its words.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from grpclib import GRPCError, Status
from modal_proto import api_pb2

MAX_TIMEOUT_SECS = 24 * 3600  # a sandbox's or a function call's longest life
MAX_NAME_LENGTH = 64
MAX_TAGS = 10  # Modal documents no number; the fake assumes 10 so a runaway tagger fails here
MAX_TAG_LENGTH = 64  # likewise (diloco's tags are short: run, rank, attempt, cancelled)
MIN_MILLI_CPU = 125  # 0.125 core, Modal's smallest request
MAX_MILLI_CPU = 64_000
MIN_MEMORY_MB = 128
MAX_MEMORY_MB = 344_064  # 336 GiB
# Modal's GPU names (modal.com/docs/guide/gpu) and the most of each one container may hold.
GPU_TYPES = {"T4": 8, "L4": 8, "A10": 4, "A10G": 4, "L40S": 8, "A100": 8, "A100-40GB": 8, "A100-80GB": 8,
             "H100": 8, "H100!": 8, "H200": 8, "B200": 8, "B200+": 8}
CLOUDS = {"aws", "gcp", "oci", "auto"}
# Modal Clusters (modal.com/docs/guide/multi-node-clusters): "up to 32 nodes and 256 GPUs per
# cluster", each container holding every GPU of its host, never a CPU-only cluster.
MAX_CLUSTER_SIZE = 32
MAX_CLUSTER_GPUS = 256
# Modal's broad regions and the cloud regions under them (modal.com/docs/guide/region-selection).
REGIONS = {"us", "us-east", "us-west", "us-central", "eu", "eu-west", "eu-north", "eu-south", "ap", "ap-northeast",
           "ap-southeast", "ap-south", "ap-melbourne", "ca", "uk", "jp", "me", "sa", "mx", "af"}
_CLOUD_REGION = re.compile(r"^[a-z]{2,}(-[a-z]+)+-?\d+$")  # us-east-1, europe-west4, eu-central-1 ...
_NAME = re.compile(r"^[a-zA-Z0-9-_.]+$")
_APP_ID = re.compile(r"^ap-[a-zA-Z0-9]{22}$")


def invalid(message: str) -> GRPCError:
    return GRPCError(Status.INVALID_ARGUMENT, message)


def check_name(name: str, kind: str) -> None:
    """Modal's rule for object names (apps, sandboxes, secrets, volumes)."""
    if not name or len(name) > MAX_NAME_LENGTH or not _NAME.match(name) or _APP_ID.match(name):
        raise invalid(f"Invalid {kind} name: '{name}'.\n\nNames may contain only alphanumeric characters, dashes, "
                      f"periods, and underscores, must be shorter than 64 characters, and cannot conflict with "
                      f"App ID strings.")


def check_timeout(seconds: int, what: str) -> None:
    if seconds <= 0 or seconds > MAX_TIMEOUT_SECS:
        raise invalid(f"{what} timeout must be between 1 and {MAX_TIMEOUT_SECS} seconds (24 hours), got {seconds}")


def check_tags(tags: Iterable[api_pb2.SandboxTag]) -> dict[str, str]:
    out: dict[str, str] = {}
    for tag in tags:
        if not tag.tag_name or len(tag.tag_name) > MAX_TAG_LENGTH or len(tag.tag_value) > MAX_TAG_LENGTH:
            raise invalid(f"Invalid tag {tag.tag_name!r}: names must be 1-{MAX_TAG_LENGTH} characters and values "
                          f"at most {MAX_TAG_LENGTH}")
        out[tag.tag_name] = tag.tag_value
    if len(out) > MAX_TAGS:
        raise invalid(f"Too many tags: {len(out)} (at most {MAX_TAGS})")
    return out


def check_resources(resources: api_pb2.Resources) -> None:
    """CPU, memory and GPU of a sandbox or function, as Modal's scheduler accepts them."""
    cpu, memory = resources.milli_cpu, resources.memory_mb
    if cpu and not MIN_MILLI_CPU <= cpu <= MAX_MILLI_CPU:
        raise invalid(f"Invalid CPU request {cpu / 1000:g}: must be between {MIN_MILLI_CPU / 1000:g} and "
                      f"{MAX_MILLI_CPU // 1000} physical cores")
    if memory and not MIN_MEMORY_MB <= memory <= MAX_MEMORY_MB:
        raise invalid(f"Invalid memory request {memory} MiB: must be between {MIN_MEMORY_MB} and {MAX_MEMORY_MB} MiB")
    gpu = resources.gpu_config
    if gpu.gpu_type or gpu.count:
        most = GPU_TYPES.get(gpu.gpu_type)
        if most is None:
            raise invalid(f"Invalid GPU type '{gpu.gpu_type}'. Value must be one of {sorted(GPU_TYPES)}")
        if not 1 <= gpu.count <= most:
            raise invalid(f"Invalid GPU count {gpu.count} for {gpu.gpu_type}: at most {most} per container")


def check_cluster(size: int, resources: api_pb2.Resources) -> None:
    """A clustered function (`@modal.clustered(size=K)`, `_experimental_group_size` K > 1): at most
    MAX_CLUSTER_SIZE containers, each requesting all the GPUs of its host (the SDK's words: "Each
    container must request all GPUs on its host (for example, gpu="H100:8"); CPU-only clusters are
    not supported"), at most MAX_CLUSTER_GPUS in all."""
    if size <= 1:
        return
    gpu = resources.gpu_config
    if size > MAX_CLUSTER_SIZE:
        raise invalid(f"Invalid cluster size {size}: a cluster has at most {MAX_CLUSTER_SIZE} containers")
    if not gpu.gpu_type or not gpu.count:
        raise invalid("Clustered Functions need GPUs: CPU-only clusters are not supported")
    most = GPU_TYPES.get(gpu.gpu_type, 0)
    if gpu.count != most:
        raise invalid(f"Invalid GPU request {gpu.gpu_type}:{gpu.count} for a clustered Function: each container must "
                      f"request all GPUs on its host ({gpu.gpu_type}:{most})")
    if size * gpu.count > MAX_CLUSTER_GPUS:
        raise invalid(f"Invalid cluster: {size} containers of {gpu.count} GPUs exceed {MAX_CLUSTER_GPUS} GPUs")


def check_placement(cloud: str, placement: api_pb2.SchedulerPlacement) -> None:
    if cloud and cloud.lower() not in CLOUDS:
        raise invalid(f"Invalid cloud provider '{cloud}'. Value must be one of {sorted(CLOUDS)}")
    for region in placement.regions:
        if region not in REGIONS and not _CLOUD_REGION.match(region):
            raise invalid(f"Invalid region '{region}'. See modal.com/docs/guide/region-selection for the regions "
                          f"Modal supports")


def not_found(kind: str, name: str, environment: str) -> GRPCError:
    """Modal's message for a named object that does not exist in the environment."""
    return GRPCError(Status.NOT_FOUND, f"{kind} '{name}' not found in environment '{environment}'")
