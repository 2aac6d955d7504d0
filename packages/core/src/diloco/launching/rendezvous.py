"""Where a run's replicas meet: choosing and checking the rendezvous URI before anything launches.

The object store is the only channel between replicas, so a URI that some replicas cannot see
does not fail loudly: each replica opens its own empty store, waits out `round_timeout`, and
trains alone while the run reports success. Two URIs do that:

- ``file://`` on a backend whose replicas run on other machines: every pod creates the
  directory on its own disk;
- ``memory://`` anywhere: it is one process's memory, and every replica is its own process.

So a backend declares whether its replicas see the launcher's filesystem
(`Capabilities.shares_launcher_filesystem`; backends that say nothing are treated as remote),
and `resolve_rendezvous` refuses those URIs with one line naming the fix. The URI comes from the
spec's `rendezvous`, else the user's default (`DILOCO_RENDEZVOUS` in the launching shell, else
`rendezvous` in the user config file), else — only for a backend that shares this machine's disk
— a directory inside the run's records.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from ..inputs import envvars
from ..errors import UserError
from ..protocol import Capabilities
from ..inputs.specvalues import check_uri, safe_uri
from ..store.objectstore import SCHEMES, scheme_list

CONFIG_KEYS = {"rendezvous"}


def config_path() -> Path:
    """$DILOCO_CONFIG, else <user config dir>/config.toml (e.g. ~/.config/diloco/config.toml)."""
    override = os.environ.get(envvars.ENV_CONFIG)
    if override:
        return Path(override).expanduser()
    import platformdirs

    return Path(platformdirs.user_config_dir("diloco")) / "config.toml"


def load_config() -> dict[str, Any]:
    """The user config file's settings ({} if there is none); a broken file is a UserError."""
    path = config_path()
    if not path.is_file():
        return {}
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: not valid TOML: {exc}") from None
    unknown = sorted(set(data) - CONFIG_KEYS)
    if unknown:
        raise UserError(f"{path}: unknown key `{unknown[0]}` (allowed: {', '.join(sorted(CONFIG_KEYS))})")
    if "rendezvous" in data and not isinstance(data["rendezvous"], str):
        raise UserError(f"{path}: `rendezvous` must be a URI string such as \"s3://bucket/diloco\"")
    return data


def user_default() -> tuple[str, str] | None:
    """(uri, where it came from) of the user's default rendezvous, if one is set."""
    env = os.environ.get(envvars.ENV_RENDEZVOUS)
    if env:
        return env, envvars.ENV_RENDEZVOUS
    uri = load_config().get("rendezvous")
    return (uri, str(config_path())) if uri else None


def check_rendezvous(uri: str, *, backend: str, shared_disk: bool, source: str) -> str:
    """Refuse a URI some replicas could not reach; return it unchanged otherwise."""
    how = (f"set `rendezvous = \"s3://bucket/prefix\"` (or gs://, az://) in the spec, or a default in "
           f"{envvars.ENV_RENDEZVOUS} or {config_path()}")
    check_uri(source, "rendezvous", uri)
    shown = safe_uri(uri)
    scheme = urlparse(uri).scheme
    if scheme not in SCHEMES:
        raise UserError(f"{source}: `rendezvous` must be a {scheme_list()} URI, got {shown!r}")
    if scheme == "memory":
        raise UserError(f"{source}: rendezvous {shown!r} lives in one process's memory and every replica is its own "
                        f"process, so each would train alone; use file:// (local backend) or s3://, gs://, az://")
    if scheme == "file" and not shared_disk:
        raise UserError(f"{source}: rendezvous {shown!r} is a directory on this machine, which {backend!r} replicas "
                        f"do not see (each would train alone on its own disk); {how}")
    return uri


def resolve_rendezvous(spec_uri: str | None, *, backend: str, capabilities: Capabilities, run_dir: Path,
                       source: str) -> str:
    """The URI the run's replicas meet at, checked against the backend's reach."""
    shared = capabilities.shares_launcher_filesystem
    if spec_uri:
        return check_rendezvous(spec_uri, backend=backend, shared_disk=shared, source=source)
    default = user_default()
    if default:
        return check_rendezvous(default[0], backend=backend, shared_disk=shared, source=default[1])
    if shared:
        return (run_dir / "store").as_uri()
    raise UserError(f"{source}: backend {backend!r} runs replicas on other machines, so they need a shared object "
                    f"store to meet in: set `rendezvous = \"s3://bucket/prefix\"` (or gs://, az://) in the spec, "
                    f"or a default in {envvars.ENV_RENDEZVOUS} or {config_path()}")
