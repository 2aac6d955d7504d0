"""The fake Modal server's sandbox RPCs, both generations the client speaks: V1 (`SandboxCreate`,
used for GPU sandboxes and by older clients) and V2 (`SandboxCreateV2`, the newer clients'
default otherwise). A V1 id is 'sb-' and 22 base62 characters, a V2 id anything else, so that
`Sandbox.from_id` routes to the same generation (the client decides by the id's shape).

`SandboxCreate*` validates the definition as Modal does (`validate`), resolves its image,
mounts, secrets and volumes, and starts the container (`containers.start`) with only the
environment the definition declares.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

from google.protobuf.empty_pb2 import Empty
from grpclib import GRPCError, Status
from modal_proto import api_pb2

from . import containers
from .store import new_id, read_json, write_json
from .validate import check_name, check_placement, check_resources, check_tags, check_timeout


def _v2_id() -> str:
    return "sb-" + new_id("v2", 20)  # not the V1 shape: the client routes it to the V2 RPCs


class SandboxRpcs:
    store: Any

    # -- creating ----------------------------------------------------------------------------------

    def _injected_create_failure(self) -> None:
        """`FakeModal.fail_creates_after(n)`: n more creations succeed, then capacity runs out."""
        plan = read_json(self.store.root / "fail-creates.json")
        if plan is None:
            return
        if plan["left"] <= 0:
            raise GRPCError(Status.RESOURCE_EXHAUSTED, plan["message"])
        write_json(self.store.root / "fail-creates.json", {**plan, "left": plan["left"] - 1})

    def _image(self, image_id: str) -> dict[str, Any]:
        image = self.store.get(image_id)
        if image is None or image.get("kind") != "image":
            raise GRPCError(Status.NOT_FOUND, f"Image {image_id} not found")
        if image["status"] != "success":
            raise GRPCError(Status.FAILED_PRECONDITION, f"Image {image_id} failed to build:\n{image['error']}")
        here = f"{sys.version_info.major}.{sys.version_info.minor}"
        if image.get("python") and image["python"] != here:  # a limit of the fake, not of Modal: say so
            raise GRPCError(Status.FAILED_PRECONDITION, f"the fake Modal cloud runs containers with this machine's "
                                                        f"Python {here}; image {image_id} has Python {image['python']}")
        return image

    def _volumes(self, mounts: Any) -> dict[str, str]:
        out = {}
        for m in mounts:
            volume = self.store.get(m.volume_id)
            if volume is None:
                raise GRPCError(Status.NOT_FOUND, f"Volume {m.volume_id} not found")
            out[m.mount_path] = volume["name"]
        return out

    def _create(self, app_id: str, d: api_pb2.Sandbox, tags: Any, env: dict[str, str], object_id: str) -> str:
        self.app(app_id)
        if d.name:
            check_name(d.name, "Sandbox")
            for other in self.store.container_ids("sb-"):
                spec = read_json(self.store.container_dir(other) / "spec.json", {})
                if spec.get("app_id") == app_id and spec.get("name") == d.name and not self.store.exit_of(other):
                    raise GRPCError(Status.ALREADY_EXISTS, f"Sandbox with name '{d.name}' already exists in the app")
        check_timeout(d.timeout_secs, "Sandbox")
        check_resources(d.resources)
        check_placement(d.cloud_provider_str, d.scheduler_placement)
        tag_map = check_tags(tags)
        image = self._image(d.image_id)
        for bucket in d.cloud_bucket_mounts:
            if bucket.credentials_secret_id:
                self.secret_values(bucket.credentials_secret_id)
        volumes = self._volumes(d.volume_mounts)
        self._injected_create_failure()
        gpu = d.resources.gpu_config
        spec = {
            "kind": "sandbox", "app_id": app_id, "name": d.name or None, "command": list(d.entrypoint_args),
            "env": env, "workdir": d.workdir or None, "timeout": d.timeout_secs, "tags": tag_map,
            "image_id": d.image_id, "python": image.get("python"), "mount_ids": list(d.mount_ids),
            "volumes": volumes, "cloud_bucket_mounts": [b.mount_path for b in d.cloud_bucket_mounts],
            "cpu": d.resources.milli_cpu / 1000 or None, "memory": d.resources.memory_mb or None,
            "gpu": (f"{gpu.gpu_type}:{gpu.count}" if gpu.count > 1 else gpu.gpu_type) or None,
            "cloud": d.cloud_provider_str or None, "regions": list(d.scheduler_placement.regions),
            "created_at": time.time(),
        }
        containers.start(self.store, object_id, spec)
        return object_id

    def rpc_SandboxCreate(self, request: api_pb2.SandboxCreateRequest) -> api_pb2.SandboxCreateResponse:
        env: dict[str, str] = {}
        for secret_id in request.definition.secret_ids:  # V1: `env` arrives as one more (ephemeral) secret
            env.update(self.secret_values(secret_id))
        sandbox_id = self._create(request.app_id, request.definition, request.tags, env, new_id("sb"))
        return api_pb2.SandboxCreateResponse(sandbox_id=sandbox_id,
                                             metadata=api_pb2.SandboxHandleMetadata(app_id=request.app_id))

    def rpc_SandboxCreateV2(self, request: api_pb2.SandboxCreateV2Request) -> api_pb2.SandboxCreateV2Response:
        env: dict[str, str] = {}
        for secret_id in request.definition.secret_ids:
            env.update(self.secret_values(secret_id))
        for source in request.secret_sources:  # V2: ephemeral secrets and `env` travel inline, in order
            env.update(self.secret_values(source.secret_id) if source.secret_id else dict(source.env.contents))
        sandbox_id = self._create(request.app_id, request.definition, request.tags, env, _v2_id())
        return api_pb2.SandboxCreateV2Response(
            sandbox_id=sandbox_id, task_id=containers.task_id_of(self.store, sandbox_id),
            metadata=api_pb2.SandboxHandleMetadata(app_id=request.app_id))

    # -- observing ---------------------------------------------------------------------------------

    def _spec(self, sandbox_id: str) -> dict[str, Any]:
        spec = read_json(self.store.container_dir(sandbox_id) / "spec.json")
        if spec is None or spec.get("kind") != "sandbox":
            raise GRPCError(Status.NOT_FOUND, f"Sandbox {sandbox_id} not found")
        return spec

    async def rpc_SandboxWait(self, request: api_pb2.SandboxWaitRequest) -> api_pb2.SandboxWaitResponse:
        """A long poll: how the sandbox ended, or nothing after `timeout` seconds (0: at once)."""
        spec = self._spec(request.sandbox_id)
        deadline = time.monotonic() + min(request.timeout, 50.0)
        while True:
            result = containers.result_of(self.store, request.sandbox_id)
            if result is not None or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.1)
        return api_pb2.SandboxWaitResponse(result=result, metadata=api_pb2.SandboxHandleMetadata(
            app_id=spec["app_id"], result=result))

    rpc_SandboxWaitV2 = rpc_SandboxWait

    async def rpc_SandboxGetTaskId(self, request: api_pb2.SandboxGetTaskIdRequest
                                   ) -> api_pb2.SandboxGetTaskIdResponse:
        self._spec(request.sandbox_id)
        deadline = time.monotonic() + 5.0
        while True:
            task_id = containers.task_id_of(self.store, request.sandbox_id)
            result = containers.result_of(self.store, request.sandbox_id)
            if task_id or result is not None or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.05)
        return api_pb2.SandboxGetTaskIdResponse(task_id=task_id, task_result=result)

    rpc_SandboxGetTaskIdV2 = rpc_SandboxGetTaskId

    def rpc_SandboxTagsGet(self, request: api_pb2.SandboxTagsGetRequest) -> api_pb2.SandboxTagsGetResponse:
        self._spec(request.sandbox_id)
        tags = read_json(self.store.container_dir(request.sandbox_id) / "tags.json", {})
        return api_pb2.SandboxTagsGetResponse(
            tags=[api_pb2.SandboxTag(tag_name=k, tag_value=v) for k, v in tags.items()])

    rpc_SandboxTagsGetV2 = rpc_SandboxTagsGet

    def rpc_SandboxTagsSet(self, request: api_pb2.SandboxTagsSetRequest) -> Empty:
        """Replaces the sandbox's whole tag set (as documented)."""
        self._spec(request.sandbox_id)
        write_json(self.store.container_dir(request.sandbox_id) / "tags.json", check_tags(request.tags))
        return Empty()

    rpc_SandboxTagsSetV2 = rpc_SandboxTagsSet

    def rpc_SandboxTerminate(self, request: api_pb2.SandboxTerminateRequest) -> api_pb2.SandboxTerminateResponse:
        self._spec(request.sandbox_id)
        containers.kill(self.store, request.sandbox_id, "terminated", 137)
        result = containers.result_of(self.store, request.sandbox_id)
        return api_pb2.SandboxTerminateResponse(existing_result=result)

    rpc_SandboxTerminateV2 = rpc_SandboxTerminate

