"""One executor over several: each replica group's ranks go to that group's backend.

The supervisor keeps one run on one executor (per-rank relaunch, gang rules, budgets and the
lease are the run's, not a group's), so a run with `[[group]]` tables is supervised through a
`GroupedExecutor`: it plans a request by splitting its ranks among the groups, asks each group's
executor for that group's plan (with the group's GPU, processes, timeout and environment), and
routes every handle back to the executor of the group holding its rank. A relaunched rank is
relaunched by its own group's backend.

Its plan is a `LaunchPlan` whose `parts` are the groups' own plans: `diloco dryrun` prints each
of them (an EKS group as YAML, a SageMaker group as its API calls), and `submit` submits exactly
those parts. All of it starts or none stays: if a later group cannot start, the groups already
started are cancelled before the error is raised, as `diloco.submitting.start_each` does for ranks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from ..inputs.envvars import ENV_GROUP
from ..errors import UserError
from ..spec.groups import ReplicaGroup, group_of
from ..protocol import Capabilities, ReplicaHandle, ReplicaResult, ReplicaStatus
from ..request import LaunchPlan, LaunchRequest, Secrets
from ..submitting import start_all


class GroupedExecutor:
    """The executors of a run's groups, as one `Executor` (see the module docstring)."""

    backend_name = "groups"

    def __init__(self, parts: Sequence[tuple[ReplicaGroup, Callable[[], Any]]]):
        """`parts`: each group with a function that builds its executor, called the first time the
        group is needed, so a shell that lacks one group's SDK or plugin can still cancel, poll and
        read the logs of every other group."""
        self.groups = [g for g, _ in parts]
        self._build = {g.name: build for g, build in parts}
        self._built: dict[str, Any] = {}
        self._building = threading.Lock()  # the supervisor's thread and its launch worker both ask
        self._added: dict[int, ReplicaGroup] = {}  # ranks `diloco scale` added to a group

    def assign(self, rank: int, group: str) -> None:
        """Rank `rank` (added by `diloco scale`) belongs to `group`."""
        self._added[rank] = next(g for g in self.groups if g.name == group)

    def executor_for_group(self, name: str) -> Any:
        with self._building:
            if name not in self._built:
                self._built[name] = self._build[name]()
            return self._built[name]

    @property
    def executors(self) -> dict[str, Any]:
        """Every group's executor by group name (building any not yet built)."""
        return {g.name: self.executor_for_group(g.name) for g in self.groups}

    @property
    def capabilities(self) -> Capabilities:
        """What the run can count on: what every group can do. A group that cannot relaunch one
        rank alone makes the whole run restart as a gang (the supervisor's rule, unchanged)."""
        caps = [e.capabilities for e in self.executors.values()]
        return Capabilities(
            shares_launcher_filesystem=all(c.shares_launcher_filesystem for c in caps),
            relaunches_one_rank=all(c.relaunches_one_rank for c in caps),
            process_groups=all(c.process_groups for c in caps),
            inter_replica_network=False,
            status_detail=any(c.status_detail for c in caps),
            numbered_reruns=any(c.numbered_reruns for c in caps),
            log_files=all(c.log_files for c in caps))

    def group_of(self, rank: int) -> ReplicaGroup:
        return self._added[rank] if rank in self._added else group_of(self.groups, rank)

    def executor_of(self, rank: int) -> Any:
        return self.executor_for_group(self.group_of(rank).name)

    def group_request(self, group: ReplicaGroup, request: LaunchRequest, ranks: Sequence[int]) -> LaunchRequest:
        """`request` (the run's) as `group` launches `ranks`: its GPU, processes, timeout, env (with
        DILOCO_GROUP naming the group, for code that sizes itself by it) and secrets: of those the
        groups list, only its own (what is not listed, such as the store's credentials, goes to all)."""
        env = {**group.env_over(request.env), ENV_GROUP: group.name}
        withheld = {n for g in self.groups for n in g.secrets} - set(group.secrets)
        secrets = Secrets({k: v for k, v in request.secrets.reveal().items() if k not in withheld})
        return replace(request, ranks=tuple(ranks), gpu=group.gpu, timeout=group.timeout,
                       processes_per_replica=group.processes_per_replica, nodes=group.nodes, env=env,
                       secrets=secrets)

    # -- the contract ------------------------------------------------------------------------

    def plan(self, request: LaunchRequest) -> LaunchPlan:
        parts = []
        for g in self.groups:
            ranks = [r for r in request.ranks if self.group_of(r) is g]
            if not ranks:
                continue
            try:
                part = self.executor_for_group(g.name).plan(self.group_request(g, request, ranks))
            except UserError as exc:
                raise type(exc)(f"group {g.name!r} ({g.backend}): {exc}") from None
            parts.append((g, part))
        body = [{"group": g.name, "backend": g.backend, "ranks": list(p.request.ranks), "format": p.format,
                 "plan": p.body} for g, p in parts]
        return LaunchPlan(backend_name=self.backend_name, request=request, body=body,
                          parts=tuple(p for _, p in parts), part_titles=tuple(g.describe() for g, _ in parts))

    def submit(self, plan: LaunchPlan) -> list[ReplicaHandle]:
        """Each group's part on its own backend; if one cannot start, whatever the error, no other
        group's replicas stay behind untracked (`diloco.submitting.start_all`)."""
        def group(part: LaunchPlan) -> ReplicaGroup:
            return self.group_of(part.request.ranks[0])

        started = start_all(plan.parts or (), lambda part: self.executor_for_group(group(part).name).submit(part),
                            self.cancel, unit="replica(s) of other groups",
                            failed=lambda part: f"group {group(part).name!r} ({group(part).backend})")
        by_rank = {h.rank: h for h in started}
        return [by_rank[r] for r in plan.request.ranks]

    def poll(self, handle: ReplicaHandle) -> ReplicaStatus:
        return self.executor_of(handle.rank).poll(handle)

    def stream_logs(self, handle: ReplicaHandle, *, n_lines: int = 200) -> str:
        return self.executor_of(handle.rank).stream_logs(handle, n_lines=n_lines)

    def cancel(self, handle: ReplicaHandle) -> None:
        self.executor_of(handle.rank).cancel(handle)

    def collect(self, handles: Sequence[ReplicaHandle], *, timeout: float | None = None) -> list[ReplicaResult]:
        by_group: dict[str, list[ReplicaHandle]] = {}
        for h in handles:
            by_group.setdefault(self.group_of(h.rank).name, []).append(h)
        results: dict[int, ReplicaResult] = {}
        for name, group_handles in by_group.items():
            for res in self.executor_for_group(name).collect(group_handles, timeout=timeout):
                results[res.rank] = res
        return [results[h.rank] for h in handles]

    def status_detail(self, handle: ReplicaHandle) -> str | None:
        executor = self.executor_of(handle.rank)
        return executor.status_detail(handle) if executor.capabilities.status_detail else None

    def reruns(self, handle: ReplicaHandle) -> int | None:
        executor = self.executor_of(handle.rank)
        return executor.reruns(handle) if executor.capabilities.numbered_reruns else None

    def log_path(self, handle: ReplicaHandle) -> Any:
        return self.executor_of(handle.rank).log_path(handle)
