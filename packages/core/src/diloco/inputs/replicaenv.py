"""The environment every replica starts with, built the same way by every backend.

Backends differ in how they start a process; they must not differ in what the process sees.
This module is the one place that turns (rank, world size, run, entrypoint args) into
environment variables and parses entrypoints; secrets never enter it (`diloco.request.Secrets`
carries them apart, and the backend adds them where its platform receives them).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import envvars as p
from .envvars import ENV_VERSION
from ..errors import SpecError, UserError
from .variables import NAME, check_variable, is_secret_name  # noqa: F401 - is_secret_name re-exported

REDACTED = "REDACTED"
_ENV_NAME = NAME
# Defaults for every replica. glibc keeps freed blocks under its dynamic mmap threshold (up to
# 32 MB) in the heap of the thread's arena; a round's shards and a lane's broadcast chunks are
# that size and are freed on pool threads, so each arena held on to what it freed: peak host
# memory grew with the threads and processes (bench/lanes.py, 100 MB model: 7.7× → 5.1× at L = 2,
# 9.8× → 6.3× at L = 4; bench/round_cost.py, one process, N = 4: 6.2× → 4.5× before streaming).
# Blocks of 8 MB and more are mapped and returned at once instead; the spec's [env] can override it.
REPLICA_ENV_DEFAULTS = {"MALLOC_MMAP_THRESHOLD_": str(8 << 20)}
GROUP_ENV_DEFAULTS = REPLICA_ENV_DEFAULTS  # the name it had while only multi-process replicas got it
_FUNCTION_REF = re.compile(r"^[A-Za-z_][\w.]*(:[A-Za-z_][\w.]*)?$")


@dataclass(frozen=True)
class Entrypoint:
    """A parsed entrypoint: an importable function ("pkg.mod:fn") or a command line."""

    function: str | None = None
    command: tuple[str, ...] | None = None

    def to_env(self) -> str:
        """DILOCO_ENTRYPOINT's value: "module:function", or a JSON array for a command.

        Plain text for functions so the in-replica bootstrap needs no JSON parser to start.
        """
        return self.function or json.dumps(list(self.command or ()))

    @classmethod
    def from_env(cls, text: str) -> Entrypoint:
        if text.startswith("["):
            return cls(command=tuple(json.loads(text)))
        return cls(function=text)

    def describe(self) -> str:
        return self.function or " ".join(self.command or ())


def parse_entrypoint(entrypoint: str | Sequence[str]) -> Entrypoint:
    """Accept "module:function", the original "module.function", or a command list."""
    if isinstance(entrypoint, str):
        text = entrypoint.strip()
        if not _FUNCTION_REF.match(text):
            raise UserError(f"entrypoint {entrypoint!r} is not 'module:function'; "
                            "give an importable function or a command list like [\"python\", \"train.py\"]")
        if ":" not in text:
            if "." not in text:
                raise UserError(f"entrypoint {entrypoint!r} names no function; write it as 'module:function'")
            module, _, func = text.rpartition(".")
            text = f"{module}:{func}"
        return Entrypoint(function=text)
    items = list(entrypoint)
    if not items or not all(isinstance(x, str) and x for x in items):
        raise UserError("entrypoint command must be a non-empty list of non-empty strings")
    return Entrypoint(command=tuple(items))


def exported_arg_name(key: str, value: Any) -> str | None:
    """The variable a scalar entrypoint arg is exported as (`lr` → `LR`), or None if it is not."""
    if isinstance(value, (str, int, float, bool)) and _ENV_NAME.match(key):
        return key.upper()
    return None


def check_entrypoint_args(args: Mapping[str, Any], where: str = "entrypoint args") -> None:
    """Refuse args that would set a reserved or cloud variable, or carry a secret in plain text:
    a secret-looking name at any depth (`[args.hub] token = ...`) is refused like one on top."""
    for key, value in args.items():
        if key == "rank_env":
            if not isinstance(value, str):
                raise SpecError(f"{where}: `args.rank_env` must be a variable name (a string), got {value!r}")
            check_variable(where, "rank_env", key, value)
            continue
        check_variable(where, "args", key, exported_arg_name(key, value) or "X")
        stack = [(f"args.{key}", value)]
        while stack:
            path, item = stack.pop()
            children = (item.items() if isinstance(item, Mapping)
                        else enumerate(item) if isinstance(item, list) else ())
            for k, v in children:
                if isinstance(k, str) and is_secret_name(k):
                    raise SpecError(f"{where}: `{path}.{k}` looks like a secret; pass it through `secrets = [...]` "
                                    f"(an environment variable exported in your shell), so its value never lands in "
                                    f"files, records or dry runs")
                stack.append((f"{path}.{k}" if isinstance(k, str) else f"{path}[{k}]", v))


def replica_env(*, rank: int, n_replicas: int, run_id: str, attempt: int,
                entrypoint: Entrypoint, entrypoint_args: Mapping[str, Any] | None,
                rendezvous: str | None, timeout: float | None,
                env: Mapping[str, str] | None = None,
                settings: Mapping[str, Any] | None = None, processes: int = 1,
                diloco_version: str | None = None) -> dict[str, str]:
    """Environment for one replica attempt (without secrets: the caller adds those last).

    Scalar entrypoint args also appear as upper-cased variables (`lr = 0.1` → `LR=0.1`) so
    command-line entrypoints can read them; the whole mapping travels as JSON for functions.

    The rank contract (docs/design.md#environment): REPLICA_RANK (or `rank_env`) is the replica's
    index and DILOCO_REPLICAS the number of replicas. WORLD_SIZE is torch's, never diloco's: with
    `processes` > 1, torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT for the replica's own process group, so user code calls `init_process_group()` as
    usual; a one-process replica has none of them, so `TrainingArguments`, accelerate and Lightning
    see one process (WORLD_SIZE = replicas made them wait for a multi-node group that never forms).
    """
    args = dict(entrypoint_args or {})
    check_entrypoint_args(args)
    rank_env = str(args.pop("rank_env", p.ENV_RANK))
    out: dict[str, str] = {}
    for key, value in args.items():
        name = exported_arg_name(key, value)
        if name:
            out[name] = str(value).lower() if isinstance(value, bool) else str(value)
    out.update(REPLICA_ENV_DEFAULTS)  # the spec's [env] below may override them
    out.update(dict(env or {}))
    out.update({
        rank_env: str(rank),
        p.ENV_RANK: str(rank),
        p.ENV_REPLICAS: str(n_replicas),
        p.ENV_RUN_ID: run_id,
        p.ENV_ATTEMPT: str(attempt),
        p.ENV_ENTRYPOINT: entrypoint.to_env(),
        p.ENV_ENTRYPOINT_ARGS: json.dumps(args, sort_keys=True),
        "PYTHONUNBUFFERED": "1",
    })
    if rendezvous:
        out[p.ENV_RENDEZVOUS] = rendezvous
    if timeout:
        out[p.ENV_TIMEOUT] = str(float(timeout))
    if settings:
        out[p.ENV_SETTINGS] = json.dumps(dict(settings), sort_keys=True)
    if diloco_version:
        out[ENV_VERSION] = diloco_version
    return out



def pinned_requirement(dist: str) -> str:
    """`dist==<the version installed here>`, so a replica installs the diloco the launcher runs
    (every backend that pip-installs diloco into an image uses this); unpinned if absent here."""
    from importlib import metadata

    try:
        return f"{dist}=={metadata.version(dist)}"
    except metadata.PackageNotFoundError:
        return dist
