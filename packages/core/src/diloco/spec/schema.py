"""The spec's own tables, declared like a backend's options: the top level (`SpecTable`) and a
`[[group]]` table (`GroupTable`), each key an `option(...)` with its type, bounds and help.

`[restart]` and `[diloco]` are declared where they are used (`diloco.spec.settings.RestartSettings`,
`diloco.spec.settings.DilocoSettings`), and every table is checked by `diloco.options.check_table`.
These classes are never built: `diloco.spec.runspec` reads the checked values as a dict. Their own module
so that `diloco.spec.runspec` (which parses a file) and `diloco.spec.groups` depend on it and not on each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import UserError
from ..options import option
from ..procgroup import MAX_NODES, MAX_PROCESSES
from ..inputs.replicaenv import parse_entrypoint


def nonempty(value: Any) -> str | None:
    """A string, or every string of an array, that says something."""
    if value == "":
        return "must be a non-empty string, got ''"
    if isinstance(value, list) and "" in value:
        return f"must be an array of non-empty strings, got {value!r}"
    return None


def named(value: Any) -> str | None:
    """A backend name, or a table whose `name` is one."""
    if isinstance(value, dict) and not (isinstance(value.get("name"), str) and value["name"]):
        return 'is a table whose `name` must name the backend, e.g. name = "local"'
    return nonempty(value)


def runnable(value: Any) -> str | None:
    """An entrypoint `diloco.inputs.replicaenv.parse_entrypoint` accepts."""
    try:
        parse_entrypoint(value)
    except UserError as exc:
        return f"cannot be run: {exc}"
    return None


BACKEND = 'a backend name or a [backend] table with name = "..."'
# Bounds the top level and a group share.
RANGE = {"replicas": {"min": 1, "max": 4096}, "processes": {"min": 1, "max": MAX_PROCESSES},
         "nodes": {"min": 1, "max": MAX_NODES},
         "timeout": {"min": 1, "max": 30 * 86400}}


@dataclass(frozen=True, kw_only=True)
class SpecTable:
    """The spec's top-level keys (`diloco.spec.runspec`); in a spec with `[[group]]` tables, `replicas` and
    `backend` are the groups' and not required here."""

    name: str | None = option(None, help="a name for the run (default: the spec file's name)", check=nonempty)
    backend: str | dict[str, Any] = option(help='e.g. backend = "local"', want=BACKEND, check=named)
    replicas: int = option(help="e.g. replicas = 4", **RANGE["replicas"])
    entrypoint: str | list[str] = option(help='e.g. entrypoint = "train:main"', check=runnable,
                                         want="'module:function' or an array of strings")
    workdir: str | None = option(None, help="where the code lives, relative to the spec (default: its folder)",
                                 check=nonempty)
    gpu: str | None = option(None, help="logical GPU name and count per node, e.g. H100:8", check=nonempty)
    processes_per_replica: int | None = option(
        None, help="processes on each node of a replica, started by torchrun (default: the node's GPU count)",
        **RANGE["processes"])
    nodes: int | None = option(None, help="machines in each replica, one torch process group across them (default 1)",
                               **RANGE["nodes"])
    timeout: float = option(3600.0, help="seconds per replica attempt", **RANGE["timeout"])
    rendezvous: str | None = option(None, help="the store's URI (default: DILOCO_RENDEZVOUS or the config)",
                                    check=nonempty)
    secrets: list[str] = option([], help="launcher environment variables forwarded, never recorded", check=nonempty)
    args: dict[str, Any] = option({}, help="the entrypoint's arguments")
    env: dict[str, Any] = option({}, help="extra environment variables (not secret)")
    restart: dict[str, Any] = option({}, help="the restart policy (diloco.spec.settings.RestartSettings)")
    diloco: dict[str, Any] = option({}, help="DiLoCo's settings (diloco.spec.settings.DilocoSettings)")
    metrics: dict[str, Any] = option({}, help="where the launcher writes round metrics")
    region: str | None = option(None, help="where the replicas run (e.g. us-east-1), for pricing their reads of the "
                                           "store", check=nonempty)
    store_region: str | None = option(None, help="the store's region (e.g. us-east-1): reads from the same region "
                                                 "are free", check=nonempty)
    group: list[dict[str, Any]] | None = option(None, help="[[group]] tables: replicas on several backends "
                                                           "(docs/groups.md)", want="[[group]] tables")


@dataclass(frozen=True, kw_only=True)
class GroupTable:
    """A `[[group]]` table (`diloco.spec.groups`): its own replicas and backend; what it leaves out of
    `INHERITED`, it inherits from the top level."""

    name: str | None = option(None, help="the group's name (default: g0, g1, ...)")
    replicas: int = option(help="e.g. replicas = 2", **RANGE["replicas"])
    backend: str | dict[str, Any] = option(help='a [group.backend] table with name = "..." and its options',
                                           want=BACKEND, check=named)
    gpu: str | None = option(None, help="as the top-level `gpu`", check=nonempty)
    processes_per_replica: int | None = option(None, help="as the top-level key", **RANGE["processes"])
    nodes: int | None = option(None, help="as the top-level key", **RANGE["nodes"])
    timeout: float | None = option(None, help="as the top-level key", **RANGE["timeout"])
    region: str | None = option(None, help="where the group runs, for pricing its reads of the store", check=nonempty)
    env: dict[str, Any] | None = option(None, help="over the top-level [env]")
    secrets: list[str] | None = option(
        None, help="the launcher's variables this group's replicas get, by name (default: the top-level "
                   "`secrets`): e.g. AWS keys meant for a Modal group kept from SageMaker jobs, which have a role")


INHERITED = ("gpu", "processes_per_replica", "nodes", "timeout", "secrets")  # `region`: see diloco.spec.estimate.placement
