"""The modal backend's `[backend]` options, declared once (`diloco backends modal` lists them).

The directory shipped into each container is not an option: it is the spec's `workdir`
(`LaunchRequest.workdir`). From Python, `function` may also be the decorated Modal function
itself; `ModalExecutor` keeps that object aside and stores its 'module:qualname' here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from diloco.options import option

MIN_CPU = 0.125  # Modal's smallest (and default) request, in physical cores
MIN_MEMORY = 128  # MiB, likewise


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
    volumes: dict[str, str] = option({}, help="Modal volumes to mount, {path = volume name}")
    bucket_mounts: dict[str, dict[str, Any]] = option(
        {}, help="cloud buckets to mount, {path = {bucket, bucket_endpoint_url, key_prefix, secret, read_only}}")
    cpu: float | None = option(None, help="CPU cores per container", min=MIN_CPU)
    memory: int | None = option(None, help="memory per container in MiB", min=MIN_MEMORY)
    region: str | list[str] | None = option(None, help="Modal region(s) to run in")
    cloud: str | None = option(None, help="Modal cloud provider to run on (aws, gcp, oci)")
    gpu_types: list[str] = option([], help="GPU names accepted besides Modal's own list")
