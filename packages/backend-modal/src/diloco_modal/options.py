"""The modal backend's `[backend]` options, declared once (`diloco backends modal` lists them).

The directory shipped into each container is not an option: it is the spec's `workdir`
(`LaunchRequest.workdir`). From Python, `function` may also be the decorated Modal function
itself; `ModalExecutor` keeps that object aside and stores its 'module:qualname' here.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

from diloco.errors import SpecError
from diloco.options import option

MIN_CPU = 0.125  # Modal's smallest (and default) request, in physical cores
MAX_CPU = 64  # the most one Modal container may ask for
MIN_MEMORY = 128  # MiB, likewise
MAX_MEMORY = 344_064  # MiB (336 GiB)
# `modal.CloudBucketMount`'s keyword arguments (modal 1.5.5 to 1.6), with their types; `bucket` is
# its `bucket_name`, and `secret` the name of a Modal secret.
BUCKET_MOUNT_KEYS = {"bucket": str, "bucket_endpoint_url": str, "key_prefix": str, "secret": str,
                     "oidc_auth_role_arn": str, "read_only": bool, "requester_pays": bool, "force_path_style": bool}
_RESERVED_PATHS = ("/", "/root", "/tmp")  # Modal mounts nothing there


@dataclass(frozen=True)
class ModalOptions:
    """What `[backend]` (name = "modal") may hold; the same names as `ModalExecutor(**overrides)`."""

    function: str | None = option(None, help="function mode: 'module:fn' (deployed with the run), 'app-name/fn' "
                                              "(already deployed), or from Python the decorated function itself")
    deploy: bool = option(False, help="function mode: deploy the function's app before launching")
    app_name: str = option("diloco", help="the Modal app sandboxes run under")
    environment: str | None = option(None, help="the Modal environment (default: the profile's)")
    image: str | None = option(None, help="a registry image holding diloco-replica (packages/replica/Dockerfile); "
                                          "default debian_slim + pip")
    python_version: str | None = option(None, help="Python of the default image")
    pip: list[str] = option([], help="extra pip requirements for the default image")
    requirements: str | None = option(None, help="a requirements file for the default image")
    include_workdir: bool = option(True, help="ship the spec's workdir into the container")
    ignore: list[str] = option([], help="gitignore-style patterns of workdir files not to ship (credentials, .env*, "
                                        "*.pem, .git, virtualenvs and .gitignored files never ship)")
    secrets: list[str] = option([], help="names of Modal secrets to attach (the store's credentials, for example)")
    # keys are mount paths (a volume at /secrets holds no secret) and a mount's fixed fields, checked
    # below; a mount's `secret` names a Modal secret
    volumes: dict[str, str] = option({}, help="Modal volumes to mount, {path = volume name}", not_secrets=True)
    bucket_mounts: dict[str, dict[str, str | bool]] = option(
        {}, help="cloud buckets to mount, {path = {bucket, bucket_endpoint_url, key_prefix, secret, read_only, "
                 "requester_pays, force_path_style, oidc_auth_role_arn}}", not_secrets=True)
    cpu: float | None = option(None, help="CPU cores per container", min=MIN_CPU, max=MAX_CPU)
    memory: int | None = option(None, help="memory per container in MiB", min=MIN_MEMORY, max=MAX_MEMORY)
    region: str | list[str] | None = option(None, help="Modal region(s) to run in")
    cloud: str | None = option(None, help="Modal cloud provider to run on (aws, gcp, oci)")
    gpu_types: list[str] = option([], help="GPU names accepted besides Modal's own list")

    def __post_init__(self) -> None:
        """What the types alone do not say, checked before anything runs (core's checks ran first):
        mount paths Modal accepts, and each bucket mount's keys and their types, so a typo
        (`readonly`) or `read_only = "yes"` fails the dry run, not the launch."""
        for key, paths in (("volumes", self.volumes), ("bucket_mounts", self.bucket_mounts)):
            for path in paths:
                if posixpath.normpath(path) != path or not path.startswith("/") or path in _RESERVED_PATHS:
                    raise SpecError(f"`backend.{key}`: mount path {path!r} must be a canonical absolute path, not "
                                    f"{', '.join(_RESERVED_PATHS)}")
        for path, mount in self.bucket_mounts.items():
            where = f"`backend.bucket_mounts` {path!r}"
            unknown = sorted(set(mount) - set(BUCKET_MOUNT_KEYS))
            if unknown:
                raise SpecError(f"{where}: unknown key {unknown[0]!r} (a bucket mount takes "
                                f"{', '.join(BUCKET_MOUNT_KEYS)})")
            for key, value in mount.items():
                if not isinstance(value, BUCKET_MOUNT_KEYS[key]):
                    raise SpecError(f"{where}: `{key}` must be {BUCKET_MOUNT_KEYS[key].__name__}, got {value!r}")
            if not mount.get("bucket"):
                raise SpecError(f"{where} needs `bucket`, the bucket's name")
            if mount.get("key_prefix") and not str(mount["key_prefix"]).endswith("/"):
                raise SpecError(f"{where}: `key_prefix` must end in '/' (it prefixes every object path)")
