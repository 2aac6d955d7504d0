"""The fake Modal server's RPCs for what a container is made of: images (recorded and checked,
never built: `images.record`), mounts and the files uploaded into them (kept, so a test sees
exactly what left the machine and a container sees only that), secrets and volumes.
"""

from __future__ import annotations

import hashlib
from typing import Any

from grpclib import GRPCError, Status
from modal_proto import api_pb2

from . import images
from .protos import env_dict, message
from .rpc_apps import IMAGE_BUILDER_VERSION, environment_of
from .store import new_id
from .validate import check_name, not_found

_PUBLISHED_MOUNTS = ("modal-client-mount-", "python-build-standalone")
_EPHEMERAL = (api_pb2.OBJECT_CREATION_TYPE_EPHEMERAL, api_pb2.OBJECT_CREATION_TYPE_ANONYMOUS_OWNED_BY_APP)


def _check_env(values: dict[str, str]) -> None:
    """What a container's environment can hold: a name without '=' or NUL, a value without NUL."""
    for key, value in values.items():
        if not key or "=" in key or "\0" in key or "\0" in value:
            raise GRPCError(Status.INVALID_ARGUMENT, f"Invalid secret key {key!r}: keys must be non-empty environment "
                                                     f"variable names, and no key or value may hold a NUL byte")


def _status(name: str) -> int:
    return getattr(api_pb2.GenericResult, f"GENERIC_STATUS_{name.upper()}")


class BuildRpcs:
    store: Any

    # -- images ------------------------------------------------------------------------------------

    def rpc_ImageGetOrCreate(self, request: api_pb2.ImageGetOrCreateRequest) -> api_pb2.ImageGetOrCreateResponse:
        """Record the definition and decide its build now (`images.record`); the client then
        joins the build (`ImageJoinStreaming`) and reads how it ended."""
        record = images.record(self.store, request.image)
        image_id = self.store.put(new_id("im"), record)
        return api_pb2.ImageGetOrCreateResponse(image_id=image_id)

    async def stream_ImageJoinStreaming(self, request: api_pb2.ImageJoinStreamingRequest):
        record = self.store.get(request.image_id)
        if record is None:
            raise GRPCError(Status.NOT_FOUND, f"Image {request.image_id} not found")
        logs = [api_pb2.TaskLogs(data=line + "\n", file_descriptor=api_pb2.FILE_DESCRIPTOR_STDOUT)
                for line in record["build_log"]]
        result = api_pb2.GenericResult(status=_status(record["status"]), exception=record.get("error", ""))
        metadata = api_pb2.ImageMetadata(image_builder_version=IMAGE_BUILDER_VERSION,
                                         python_version_info=record.get("python", ""))
        yield api_pb2.ImageJoinStreamingResponse(task_logs=logs, entry_id="1")
        yield api_pb2.ImageJoinStreamingResponse(result=result, metadata=metadata, entry_id="2", eof=True)

    # -- mounts and uploaded files -----------------------------------------------------------------

    def rpc_MountBatchedCheckExistence(self, request: api_pb2.MountBatchedCheckExistenceRequest
                                       ) -> api_pb2.MountBatchedCheckExistenceResponse:
        missing = [h for h in request.sha256_hex_hashes if not self.store.blob_path(h).exists()]
        return api_pb2.MountBatchedCheckExistenceResponse(missing_sha256_hex_hashes=missing)

    def rpc_MountPutFile(self, request: api_pb2.MountPutFileRequest) -> api_pb2.MountPutFileResponse:
        """An uploaded file, checked against its hash and kept (large files go through blobs, which
        the fake does not implement: BlobCreate answers UNIMPLEMENTED)."""
        if request.WhichOneof("data_oneof") != "data":
            raise GRPCError(Status.INVALID_ARGUMENT, "the fake keeps files sent inline only (under 4 MiB)")
        if hashlib.sha256(request.data).hexdigest() != request.sha256_hex:
            raise GRPCError(Status.INVALID_ARGUMENT, f"sha256 mismatch for uploaded file {request.sha256_hex}")
        self.store.blob_path(request.sha256_hex).write_bytes(request.data)
        return api_pb2.MountPutFileResponse(exists=True)

    def rpc_MountGetOrCreate(self, request: api_pb2.MountGetOrCreateRequest) -> api_pb2.MountGetOrCreateResponse:
        if request.deployment_name:
            return self._published_mount(request)
        files = []
        for f in request.files:
            blob = self.store.blob_path(f.sha256_hex)
            if not blob.exists():
                raise GRPCError(Status.FAILED_PRECONDITION, f"file {f.filename} ({f.sha256_hex}) was never uploaded")
            files.append({"filename": f.filename, "sha256_hex": f.sha256_hex, "size": blob.stat().st_size,
                          "mode": f.mode})
        mount_id = self.store.put(new_id("mo"), {"kind": "mount", "files": files})
        digest = hashlib.sha256("".join(sorted(f["sha256_hex"] + f["filename"] for f in files)).encode())
        metadata = api_pb2.MountHandleMetadata(content_checksum_sha256_hex=digest.hexdigest())
        return api_pb2.MountGetOrCreateResponse(mount_id=mount_id, handle_metadata=metadata)

    def _published_mount(self, request: api_pb2.MountGetOrCreateRequest) -> api_pb2.MountGetOrCreateResponse:
        """Modal's own published mounts (the client package a function's container runs, a
        standalone Python): they exist, empty here, since a container runs this machine's
        Python and modal. Any other name is looked up in the workspace, which holds none."""
        name = request.deployment_name
        if request.namespace == api_pb2.DEPLOYMENT_NAMESPACE_GLOBAL and name.startswith(_PUBLISHED_MOUNTS):
            mount_id = self.store.put(f"mo-published-{name.replace('.', '-')}",
                                      {"kind": "mount", "published": name, "files": []})
            return api_pb2.MountGetOrCreateResponse(mount_id=mount_id)
        raise not_found("Mount", name, environment_of(request.environment_name))

    # -- secrets and volumes -----------------------------------------------------------------------

    def rpc_SecretGetOrCreate(self, request: api_pb2.SecretGetOrCreateRequest) -> api_pb2.SecretGetOrCreateResponse:
        """`Secret.from_dict` (an ephemeral secret holding the values) or `Secret.from_name` (a
        named secret of the workspace, NOT_FOUND as Modal says it when there is none)."""
        env = environment_of(request.environment_name)
        if request.object_creation_type in _EPHEMERAL:
            values = env_dict(request)
            _check_env(values)
            if request.deployment_name:
                raise GRPCError(Status.INVALID_ARGUMENT, "an ephemeral secret has no name")
            if request.object_creation_type == api_pb2.OBJECT_CREATION_TYPE_ANONYMOUS_OWNED_BY_APP:
                self.app(request.app_id)  # lives as long as that app
            elif request.app_id:
                raise GRPCError(Status.INVALID_ARGUMENT, "an ephemeral secret belongs to no app")
            secret_id = self.store.put(new_id("st"), {"kind": "secret", "name": None, "values": values})
            return api_pb2.SecretGetOrCreateResponse(secret_id=secret_id)
        if env_dict(request) or request.object_creation_type != api_pb2.OBJECT_CREATION_TYPE_UNSPECIFIED:
            raise GRPCError(Status.UNIMPLEMENTED, "creating a named secret is not implemented by diloco's fake "
                                                  "Modal server: tests add one with FakeModal.add_secret")
        name = request.deployment_name
        check_name(name, "Secret")
        values = self.store.named("secrets").get(name)
        if values is None:
            raise not_found("Secret", name, env)
        missing = [k for k in request.required_keys if k not in values]
        if missing:
            raise GRPCError(Status.NOT_FOUND, f"Secret '{name}' is missing key(s): {', '.join(missing)}")
        secret_id = self.store.put(f"st-named-{name}", {"kind": "secret", "name": name})
        metadata = message(api_pb2.SecretMetadata, name=name, keys=sorted(values), environment_name=env)
        return api_pb2.SecretGetOrCreateResponse(secret_id=secret_id, metadata=metadata)

    def secret_values(self, secret_id: str) -> dict[str, str]:
        """A secret's values when a container starts (a named one is read then: its latest values)."""
        record = self.store.get(secret_id)
        if record is None:
            raise GRPCError(Status.NOT_FOUND, f"Secret {secret_id} not found")
        if record["name"] is None:
            return dict(record["values"])
        values = self.store.named("secrets").get(record["name"])
        if values is None:
            raise not_found("Secret", record["name"], "main")
        return dict(values)

    def rpc_VolumeGetOrCreate(self, request: api_pb2.VolumeGetOrCreateRequest) -> api_pb2.VolumeGetOrCreateResponse:
        env = environment_of(request.environment_name)
        name = request.deployment_name
        if request.object_creation_type in _EPHEMERAL or not name:
            raise GRPCError(Status.INVALID_ARGUMENT, "the fake holds named volumes only")
        check_name(name, "Volume")
        if name not in self.store.named("volumes"):
            if request.object_creation_type != api_pb2.OBJECT_CREATION_TYPE_CREATE_IF_MISSING:
                raise not_found("Volume", name, env)
            self.store.set_named("volumes", name, {})
        volume_id = self.store.put(f"vo-named-{name}", {"kind": "volume", "name": name})
        return api_pb2.VolumeGetOrCreateResponse(volume_id=volume_id, version=request.version,
                                                 metadata=api_pb2.VolumeMetadata(name=name))
