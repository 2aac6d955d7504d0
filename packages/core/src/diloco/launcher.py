"""From a spec to a supervised run, and from a run record back to a live supervisor.

This is the one place that knows how a spec maps onto `launch_replicas` arguments, so
`diloco run`, `diloco dryrun` and `diloco resume` cannot drift apart.
"""

from __future__ import annotations

import inspect
import json
import os
from dataclasses import asdict
from typing import Any

from .errors import SpecError, UserError
from .plugins import get_backend
from .procgroup import accepts_processes
from .protocol import ENV_SETTINGS, LaunchPlan, ServerlessExecutor
from .rendezvous import resolve_rendezvous
from .sinks import check_sinks_installed
from .spec import RunSpec, validate_backend_options
from .state import RunRecord, new_run_id, state_dir
from .supervisor import LaunchArgs, Supervisor


def takes_workdir(cls: type) -> bool:
    """Whether an executor receives the spec's `workdir`: its __init__ names a `workdir`
    parameter or takes **kwargs (the rule for third-party executors, documented in
    packages/core/README.md#writing-a-backend)."""
    params = inspect.signature(cls.__init__).parameters.values()
    return any(p.name == "workdir" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def make_executor(backend: str, options: dict[str, Any], *, workdir: str | None = None,
                  source: str = "<spec>") -> ServerlessExecutor:
    """Instantiate a backend's executor with its [backend] options, validated first."""
    info = get_backend(backend)
    opts = dict(options)
    if workdir and takes_workdir(info.cls):
        opts.setdefault("workdir", workdir)
    validate_backend_options(source, info.cls, opts)
    try:
        return info.cls(**opts)
    except (TypeError, ValueError) as exc:
        raise SpecError(f"{source}: [backend] options for {backend!r}: {exc}") from None


def launch_args(spec: RunSpec, run_id: str, executor: ServerlessExecutor) -> LaunchArgs:
    env = dict(spec.env)
    if spec.diloco:
        env[ENV_SETTINGS] = json.dumps(spec.diloco, sort_keys=True)
    rendezvous = resolve_rendezvous(spec.rendezvous, backend=spec.backend, executor=executor,
                                    run_dir=state_dir() / "runs" / run_id, source=spec.source)
    if spec.processes_per_replica > 1 and not accepts_processes(executor):
        raise SpecError(f"{spec.source}: backend {spec.backend!r} cannot start several processes per replica "
                        f"(processes_per_replica = {spec.processes_per_replica}); use processes_per_replica = 1 "
                        f"or a backend that supports it (local, eks, modal, sagemaker)")
    return LaunchArgs(n_replicas=spec.replicas, entrypoint=spec.entrypoint, entrypoint_args=dict(spec.args),
                      gpu=spec.gpu, timeout=spec.timeout, run_id=run_id, rendezvous=rendezvous, env=env,
                      processes_per_replica=spec.processes_per_replica)


def secret_values(names: list[str], source: str) -> dict[str, str]:
    """Read the spec's `secrets` from this shell's environment; they are never recorded."""
    missing = [n for n in names if n not in os.environ]
    if missing:
        raise UserError(f"{source}: secret {missing[0]} is listed in `secrets` but not set in this shell; "
                        f"export it or remove it from the spec")
    return {n: os.environ[n] for n in names}


def plan(executor: ServerlessExecutor, args: LaunchArgs, secrets: dict[str, str]) -> LaunchPlan:
    """The request the first launch of every rank would submit."""
    return executor.dryrun(args.n_replicas, args.entrypoint, args.entrypoint_args, gpu=args.gpu,
                           timeout=args.timeout, run_id=args.run_id, rendezvous=args.rendezvous, env=args.env,
                           secret_env=secrets, **args.processes_kwargs())


def dryrun(spec: RunSpec) -> LaunchPlan:
    executor = make_executor(spec.backend, spec.backend_options, workdir=spec.workdir, source=spec.source)
    return plan(executor, launch_args(spec, new_run_id(spec.name), executor),
                {n: os.environ.get(n, "") for n in spec.secrets})


def new_run(spec: RunSpec, **supervisor_kwargs: Any) -> Supervisor:
    """Validate everything that can be validated, record the run, and return its supervisor."""
    executor = make_executor(spec.backend, spec.backend_options, workdir=spec.workdir, source=spec.source)
    secrets = secret_values(spec.secrets, spec.source)
    run_id = new_run_id(spec.name)
    args = launch_args(spec, run_id, executor)
    plan(executor, args, secrets)  # anything wrong with the request fails here, before a record exists
    check_sinks_installed(spec.metrics, spec.source)
    record = RunRecord.create(run_id, {"spec": spec.to_dict(), "backend": spec.backend,
                                       "launch": asdict(args), "state": "INIT"})
    return Supervisor(executor, record, args, spec.restart, secret_env=secrets, **supervisor_kwargs)


def executor_for(record: RunRecord) -> ServerlessExecutor:
    spec = RunSpec.from_dict(record.data["spec"])
    return make_executor(spec.backend, spec.backend_options, workdir=spec.workdir, source=spec.source)


def resume_run(record: RunRecord, **supervisor_kwargs: Any) -> Supervisor:
    """A supervisor for a recorded run, reattached to its live replicas through their handles."""
    spec = RunSpec.from_dict(record.data["spec"])
    executor = executor_for(record)
    secrets = secret_values(spec.secrets, spec.source)
    args = LaunchArgs(**record.data["launch"])
    return Supervisor(executor, record, args, spec.restart, secret_env=secrets, **supervisor_kwargs)
