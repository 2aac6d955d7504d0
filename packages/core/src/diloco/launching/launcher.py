"""From a spec to a supervised run, and from a run record back to a live supervisor.

The one place that turns a spec into a `LaunchRequest` and asks the backend for its plan, so
`diloco run`, `diloco dryrun` and `diloco resume` cannot drift apart: `dryrun` prints
`plan_run(spec).render()`, and `new_run` hands the supervisor that same plan object to submit.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import BackendNotFound, SpecError, UserError
from ..plugins.discovery import get_backend, make_executor
from ..inputs.envvars import ENV_SETTINGS
from ..protocol import Executor
from .rendezvous import resolve_rendezvous
from ..request import LaunchPlan, LaunchRequest, Secrets
from ..spec.settings import DilocoSettings
from ..plugins.sinks import check_sinks_installed
from ..spec.runspec import RunSpec
from ..runrecord.state import RunRecord, new_run_id
from ..host.statedir import state_dir
from ..supervise.supervisor import Supervisor
from ..shipping.wheelhouse import run_versions


def executor_of_spec(spec: RunSpec) -> Executor:
    """The run's executor: its backend's, or one over each group's backend (`diloco.launching.groupexec`)."""
    if not spec.groups:
        return make_executor(get_backend(spec.backend).cls, dict(spec.backend_options), source=spec.source)
    from .groupexec import GroupedExecutor

    def builder(g: Any) -> Any:
        def build() -> Executor:
            where = f"{spec.source}: group {g.name!r}"
            try:
                cls = get_backend(g.backend).cls
            except BackendNotFound as exc:
                raise BackendNotFound(f"{where}: {exc}") from None
            return make_executor(cls, dict(g.backend_options), source=where)
        return build

    # Each group's executor is built when the group is first needed: a shell without one group's
    # plugin or SDK can still see and cancel the others (run and dryrun need, and build, them all).
    return GroupedExecutor([(g, builder(g)) for g in spec.groups])


def _group_executors(spec: RunSpec, executor: Executor) -> list[tuple[Any, Executor]]:
    """Each group with the executor that runs it (the one executor, for a spec without groups)."""
    from .groupexec import GroupedExecutor

    if isinstance(executor, GroupedExecutor):
        return [(g, executor.executor_for_group(g.name)) for g in executor.groups]
    return [(g, executor) for g in spec.replica_groups()]


def launch_request(spec: RunSpec, run_id: str, executor: Executor, secrets: Secrets) -> LaunchRequest:
    """The request for the first launch of every rank; refuses what a group's backend cannot do.
    The rendezvous rule applies to the union of the groups: any remote group needs a remote store."""
    env = dict(spec.env)
    if spec.diloco:
        env[ENV_SETTINGS] = DilocoSettings.from_table(spec.diloco, where=spec.source).to_env()
    parts = _group_executors(spec, executor)
    remote = [(g, e) for g, e in parts if not e.capabilities.shares_launcher_filesystem]
    group, reach = (remote or parts)[0]
    try:
        rendezvous = resolve_rendezvous(spec.rendezvous, backend=group.backend, capabilities=reach.capabilities,
                                        run_dir=state_dir() / "runs" / run_id, source=spec.source)
    except UserError as exc:
        if not spec.groups:
            raise
        raise type(exc)(f"{exc} (group {group.name!r} runs on {group.backend})") from None
    for g, e in parts:
        if g.processes_per_replica > 1 and not e.capabilities.process_groups:
            raise SpecError(f"{spec.source}: backend {g.backend!r} cannot start several processes per replica "
                            f"(processes_per_replica = {g.processes_per_replica}); use processes_per_replica = 1 "
                            f"or a backend that supports it (local, eks, modal, sagemaker)")
        if g.nodes > 1 and not e.capabilities.multi_node:
            raise SpecError(f"{spec.source}: backend {g.backend!r} cannot place several machines together as one "
                            f"replica (nodes = {g.nodes}); use nodes = 1 or a backend that can (local, slurm, eks, "
                            f"sagemaker, modal)")
    try:
        return LaunchRequest(run_id=run_id, n_replicas=spec.replicas, entrypoint=spec.entrypoint,
                             args=dict(spec.args), env=env, secrets=secrets, rendezvous=rendezvous,
                             timeout=spec.timeout, processes_per_replica=spec.processes_per_replica, nodes=spec.nodes,
                             gpu=spec.gpu,
                             workdir=spec.workdir)
    except UserError as exc:
        raise SpecError(f"{spec.source}: {exc}") from None


def secret_values(names: list[str], source: str) -> Secrets:
    """Read the spec's `secrets` from this shell's environment; they are never recorded."""
    missing = [n for n in names if n not in os.environ]
    if missing:
        raise UserError(f"{source}: secret {missing[0]} is listed in `secrets` but not set in this shell; "
                        f"export it or remove it from the spec")
    return Secrets({n: os.environ[n] for n in names})


def plan_run(spec: RunSpec, *, run_id: str | None = None, secrets: Secrets | None = None,
             executor: Executor | None = None) -> LaunchPlan:
    """The plan of the run's first launch: what `diloco dryrun` prints and `diloco run` submits.

    A dry run refuses a listed secret that is not set, and a metric sink that is not installed, as
    `run` does: what passes one passes the other."""
    check_sinks_installed(spec.metrics, spec.source)
    executor = executor or executor_of_spec(spec)
    if secrets is None:
        secrets = secret_values(spec.secret_names(), spec.source)
    request = launch_request(spec, run_id or new_run_id(spec.name), executor, secrets)
    return executor.plan(request)


def new_run(spec: RunSpec, **supervisor_kwargs: Any) -> Supervisor:
    """Validate everything that can be validated, plan, record the run, and return its supervisor,
    which submits exactly the plan made here."""
    executor = executor_of_spec(spec)
    secrets = secret_values(spec.secret_names(), spec.source)
    plan = plan_run(spec, secrets=secrets, executor=executor)  # anything wrong fails here, before a record exists
    request = plan.request
    record = RunRecord.create(request.run_id, {"spec": spec.to_dict(), "backend": spec.backend,
                                               "launch": request.to_dict(), "state": "INIT"})
    return Supervisor(executor, record, request, spec.restart, first_plan=plan, **supervisor_kwargs)


def executor_for(record: RunRecord) -> Executor:
    executor = executor_of_spec(record.spec)
    for rank, group in (record.data.get("scaled_ranks") or {}).items():  # ranks `diloco scale` added
        executor.assign(int(rank), str(group))
    return executor


def resume_run(record: RunRecord, **supervisor_kwargs: Any) -> Supervisor:
    """A supervisor for a recorded run, reattached to its live replicas through their handles."""
    spec = record.spec
    executor = executor_for(record)
    secrets = secret_values(spec.secret_names(), spec.source)
    request = LaunchRequest.from_dict(record.launch, secrets.reveal())
    here = run_versions()
    if request.diloco_version and request.diloco_version != here:
        raise UserError(f"run {record.run_id} was launched with {request.diloco_version} but this shell has "
                        f"{here or 'no diloco-core'}: resume it from an environment with that diloco (relaunched "
                        f"replicas must run the diloco the others run)")
    return Supervisor(executor, record, request, spec.restart, **supervisor_kwargs)
