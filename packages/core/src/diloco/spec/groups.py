"""Replica groups: one run whose replicas run on several backends at once.

DiLoCo replicas meet only through the object store, so nothing but the launcher ties a run to
one platform. A spec with `[[group]]` tables runs each group on its own backend (two H100 nodes
on EKS, A100s on Modal, spot capacity on SageMaker); the top-level keys are defaults every
group inherits, and ranks are numbered group by group::

    rendezvous = "s3://bucket/runs"         # any remote group needs a remote store
    [[group]]
    name = "k8s"                            # default g0, g1, ...
    replicas = 2
    gpu = "H100:8"
    region = "us-east-1"                    # where it runs: egress is priced against the store's region
    [group.env]   ...                       # over the top-level [env]
    secrets = ["HF_TOKEN"]                  # instead of the top-level `secrets`: what this group's replicas get
    [group.backend]
    name = "eks"                            # and that backend's options
    image = "..."

A spec without groups is one group ("g0") of its top-level `replicas` on its `backend`; every
part of the launcher reads `RunSpec.replica_groups()` and so treats both alike.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import SpecError
from ..options import check_table
from ..records import from_record, to_record
from .schema import GroupTable

MAX_GROUPS = 64
GROUP_NAME = re.compile(r"[a-z][a-z0-9-]{0,30}")  # fullmatch: no trailing newline slips through


@dataclass(frozen=True)
class ReplicaGroup:
    """One group of a run: `replicas` ranks from `first_rank` on, all on one backend.

    `env` is the group's own `[group.env]` (the run's `[env]` is under it, see `env_over`);
    `secrets` the names of the launcher's variables its replicas get (its own list, or the run's);
    `region` is where the group runs, if its table says, for pricing its reads of the store
    (`diloco.spec.estimate.placement`: else its backend's `region` option, else the run's)."""

    name: str
    backend: str
    replicas: int
    first_rank: int
    timeout: float
    processes_per_replica: int = 1
    nodes: int = 1
    gpu: str | None = None
    region: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    secrets: list[str] = field(default_factory=list)
    backend_options: dict[str, Any] = field(default_factory=dict)

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.replicas)

    def env_over(self, run_env: Mapping[str, str]) -> dict[str, str]:
        """The environment a replica of this group gets: the run's, with the group's over it."""
        return {**run_env, **self.env}

    def describe(self) -> str:
        last = self.first_rank + self.replicas - 1
        ranks = f"rank {self.first_rank}" if self.replicas == 1 else f"ranks {self.first_rank}-{last}"
        island = ", ".join(x for x in (f"{self.nodes} nodes" if self.nodes > 1 else "", self.gpu or "") if x)
        return f"group {self.name}: {self.replicas} × {self.backend}{f' ({island})' if island else ''}, {ranks}"

    def to_dict(self) -> dict[str, Any]:
        return to_record(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ReplicaGroup:
        return from_record(cls, data, where="a recorded group")

    def to_table(self) -> dict[str, Any]:
        """The group as its `[[group]]` table (every value explicit, so nothing is re-inherited)."""
        table: dict[str, Any] = {"name": self.name, "replicas": self.replicas, "timeout": self.timeout,
                                 "processes_per_replica": self.processes_per_replica, "nodes": self.nodes,
                                 "backend": {"name": self.backend, **self.backend_options}}
        for key in ("gpu", "region"):
            if getattr(self, key) is not None:
                table[key] = getattr(self, key)
        if self.env:
            table["env"] = dict(self.env)
        table["secrets"] = list(self.secrets)
        return table


def group_of(groups: list[ReplicaGroup], rank: int) -> ReplicaGroup:
    for g in groups:
        if rank in g.ranks:
            return g
    raise KeyError(f"no group holds rank {rank}")


def rank_groups(spec_data: Mapping[str, Any] | None) -> dict[int, str]:
    """Rank → group name from a recorded spec (plain data), for runs with `[[group]]` tables;
    empty for a one-backend run (nothing to name). Read by status, timeline, progress and list."""
    groups = (spec_data or {}).get("groups") or []
    out: dict[int, str] = {}
    for g in groups:
        try:
            first, n, name = int(g["first_rank"]), int(g["replicas"]), str(g["name"])
        except (KeyError, TypeError, ValueError):
            return {}
        out.update({r: name for r in range(first, first + n)})
    return out


def check_groups(where: str, tables: Any, defaults: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The `[[group]]` tables, each checked against `diloco.spec.schema.GroupTable` with the top-level keys in
    `defaults` filled in for what it leaves out; names given or g0, g1, …, each once."""

    if not isinstance(tables, list) or not tables or not all(isinstance(t, dict) for t in tables):
        raise SpecError(f"{where}: `group` must be [[group]] tables, each with `replicas` and a [group.backend]")
    if len(tables) > MAX_GROUPS:
        raise SpecError(f"{where}: {len(tables)} [[group]] tables; a run has at most {MAX_GROUPS}")
    out, seen = [], set()
    for i, table in enumerate(tables):
        name = table.get("name", f"g{i}")
        if not isinstance(name, str) or not GROUP_NAME.fullmatch(name):
            raise SpecError(f"{where}: `group[{i}].name` must be lowercase letters, digits and '-' (at most "
                            f"31, starting with a letter), got {str(name)[:40]!r}")
        if name in seen:
            raise SpecError(f"{where}: two groups are named {name!r}; give each group its own name")
        seen.add(name)
        checked = check_table(f"{where}: group {name!r}", table, GroupTable, prefix="group.")
        for key, value in defaults.items():
            if key not in table:
                checked[key] = value
        checked["name"] = name
        out.append(checked)
    return out
