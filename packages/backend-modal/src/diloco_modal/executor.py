"""ModalExecutor: replicas as Modal sandboxes built from the spec, or calls of your own Modal function.

Two modes, one executor:

- **Sandbox mode** (default): from the spec alone (gpu, an image or debian_slim + pip, the
  workdir's code, forwarded and named secrets, volumes, bucket mounts, timeout, region, cloud)
  each replica attempt is one `modal.Sandbox` running the replica command every backend runs
  (`diloco.procgroup.replica_command`: the runner, or torchrun over L processes). Sandboxes,
  not functions, because a sandbox is a process: it has an exit code (so a config error, a
  preemption or an OOM kill reads as such), its own logs, tags (run, rank, attempt), `from_id`
  for durable handles, and `terminate`; and nothing has to be deployed first.
- **Function mode** (`[backend] function = "module:fn"` or `"app-name/fn-name"`): the user owns
  the `@app.function` (image, GPU, volumes, secrets, timeout); each replica is `fn.spawn(rank=i,
  diloco_env=..., processes_per_replica=L, diloco_secrets=...)`, whose body calls
  `diloco_modal.run_replica`. The spec's forwarded `secrets` travel as that call's input (Modal
  keeps inputs for the call's lifetime); long-lived credentials belong in the function's own
  `secrets=[modal.Secret.from_name(...)]`.

Durable handles hold only ids (`sb-…`, `fc-…`), rebuilt with `Sandbox.from_id` /
`FunctionCall.from_id`, so `diloco status/logs/cancel/resume` work from any shell after the
launcher is gone. Function calls are watched through `get_call_graph()` (status only) and their
logs, never `get()`: that would unpickle whatever the remote side returned, and nothing diloco
reads from a network is unpickled.

modal is imported on first use, never at import or for `dryrun` of sandbox mode.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import Any

from diloco.envvars import ENV_PREEMPTION_SIGNAL
from diloco.errors import BackendError, UserError
from diloco.failures import cause_from_log, signal_cause
from diloco.launchenv import REDACTED, check_ranks, is_secret_name, parse_entrypoint, redact_env, replica_env
from diloco.procgroup import replica_command
from diloco.protocol import LaunchPlan, ReplicaHandle, ReplicaResult, ReplicaStatus
from diloco.state import new_run_id
from diloco.waiting import poll_until_terminal, unless_failed

from . import definition as d

PREEMPTION_SIGNAL = "SIGINT"  # Modal's preemption notice to a container (modal.com/docs/guide/preemption)
RUN_TAG, RANK_TAG, ATTEMPT_TAG = "diloco-run", "diloco-rank", "diloco-attempt"


def _sdk():
    try:
        import modal
    except ImportError:  # pragma: no cover - modal is a dependency of this package
        raise UserError("the modal backend needs the modal SDK: pip install diloco-backend-modal") from None
    return modal


def dashboard_url(object_id: str) -> str:
    return f"https://modal.com/id/{object_id}"


class ModalExecutor:
    """Replicas as Modal Sandboxes (default) or as calls of a Modal Function (`function`).

    Args:
        workdir: the directory shipped into each container (the spec's directory by default).
        function: function mode: 'module:fn' (deployed with the run), 'app-name/fn' (already deployed), or from
            Python the decorated function itself.
        deploy: function mode: deploy the function's app before launching.
        app_name: the Modal app sandboxes run under.
        environment: the Modal environment (default: the profile's).
        image: a registry image holding diloco-replica (packages/replica/Dockerfile); default debian_slim + pip.
        python_version: Python of the default image.
        pip: extra pip requirements for the default image.
        requirements: a requirements file for the default image.
        include_workdir: ship workdir into the container.
        secrets: names of Modal secrets to attach (the store's credentials, for example).
        volumes: Modal volumes to mount, {path = volume name}.
        bucket_mounts: cloud buckets to mount, {path = {bucket, bucket_endpoint_url, key_prefix, secret, read_only}}.
        cpu: CPU cores per container.
        memory: memory per container in MiB.
        region: Modal region(s) to run in.
        cloud: Modal cloud provider to run on (aws, gcp, oci).
        gpu_types: GPU names accepted besides Modal's own list.
    """

    backend_name = "modal"
    supports_inter_replica_network = False
    supports_rank_relaunch = True
    shares_launcher_filesystem = False  # containers have their own disks: the rendezvous must be an object store

    def __init__(self, *, workdir: str | None = None, function: Any = None, deploy: bool = False,
                 app_name: str = "diloco", environment: str | None = None, image: str | None = None,
                 python_version: str | None = None, pip: list[str] | None = None, requirements: str | None = None,
                 include_workdir: bool = True, secrets: list[str] | None = None,
                 volumes: dict[str, str] | None = None, bucket_mounts: dict[str, dict[str, Any]] | None = None,
                 cpu: float | None = None, memory: int | None = None, region: str | list[str] | None = None,
                 cloud: str | None = None, gpu_types: list[str] | None = None):
        self.workdir = workdir
        self._function_obj = None
        if function is not None and not isinstance(function, str):  # from Python: the decorated function itself
            if not (hasattr(function, "spawn") and hasattr(function, "remote")):
                raise TypeError(f"function must be a Modal function (decorated with @app.function, so it has spawn "
                                f"and remote), got {type(function).__name__}")
            self._function_obj = function
            function = f"{getattr(function, '__module__', '?')}:{getattr(function, '__qualname__', repr(function))}"
        self.function_ref = function
        self.deploy = deploy
        self.opts = d.SandboxOptions(
            app_name=app_name, environment=environment, image=image, python_version=python_version,
            pip=list(pip or []), requirements=requirements, include_workdir=include_workdir,
            secrets=list(secrets or []), volumes=dict(volumes or {}), bucket_mounts=dict(bucket_mounts or {}),
            cpu=cpu, memory=memory, region=region, cloud=cloud, gpu_types=list(gpu_types or []))
        if self._function_obj is None and function is not None and ("/" not in function and ":" not in function):
            raise ValueError(f"function {function!r} must be 'module:function' or 'app-name/function-name'")
        self._objects: dict[str, Any] = {}

    @property
    def mode(self) -> str:
        return "function" if self.function_ref else "sandbox"

    # -- talking to Modal ----------------------------------------------------------------------

    def _call(self, what: str, fn, *args, **kwargs):
        """One SDK call, with Modal's errors turned into one line that names what failed."""
        modal = _sdk()
        exc_mod = modal.exception
        try:
            return fn(*args, **kwargs)
        except exc_mod.AuthError:
            raise UserError("no Modal token configured: run `modal token new` (or set MODAL_TOKEN_ID and "
                            "MODAL_TOKEN_SECRET)") from None
        except exc_mod.NotFoundError as exc:
            raise UserError(f"Modal cannot find what {what} needs: {exc}") from None
        except exc_mod.ExecutionError as exc:
            if "not been hydrated" in str(exc):
                raise UserError(f"Modal function {self.function_ref!r} is not deployed (its app is not running): "
                                f"run `modal deploy` on its module, or set [backend] deploy = true") from None
            raise BackendError(f"Modal failed to {what}: {exc}") from None
        except exc_mod.InvalidError as exc:
            raise UserError(f"Modal refused to {what}: {exc}") from None
        except exc_mod.Error as exc:
            raise BackendError(f"Modal failed to {what}: {type(exc).__name__}: {exc}") from None

    def _object(self, md: dict[str, Any]) -> Any:
        """The sandbox or function call a handle names, rebuilt from its id (cached per executor)."""
        oid = md["id"]
        if oid not in self._objects:
            modal = _sdk()
            cls = modal.Sandbox if md["mode"] == "sandbox" else modal.FunctionCall
            self._objects[oid] = self._call(f"find {oid}", cls.from_id, oid)
        return self._objects[oid]

    # -- planning ------------------------------------------------------------------------------

    def _replica_env(self, rank, n_replicas, run_id, attempt, ep, args, rendezvous, timeout, env, processes):
        out = replica_env(rank=rank, n_replicas=n_replicas, run_id=run_id, attempt=attempt, entrypoint=ep,
                          entrypoint_args=args, rendezvous=rendezvous, timeout=timeout, env=env, processes=processes)
        out.pop("PYTHONPATH", None)
        out[ENV_PREEMPTION_SIGNAL] = PREEMPTION_SIGNAL
        if self.mode == "sandbox" and self.opts.include_workdir and self.workdir:
            out["PYTHONPATH"] = d.CODE_DIR
        return out

    def _plan(self, n_replicas, entrypoint, entrypoint_args, *, gpu, timeout, run_id, rendezvous, ranks,
              attempt, env, secret_env, processes) -> tuple[str, dict[str, Any], dict[str, str], dict[int, dict]]:
        """(run id, the request as data with secret values redacted, the secret values, each rank's
        environment without them)."""
        ep = parse_entrypoint(entrypoint)
        run_id = run_id or new_run_id("modal")
        chosen = check_ranks(n_replicas, ranks)
        args = dict(entrypoint_args or {})
        per_rank = {r: self._replica_env(r, n_replicas, run_id, attempt, ep, args, rendezvous, timeout, env, processes)
                    for r in chosen}
        secrets = dict(secret_env or {})
        for e in per_rank.values():
            secrets.update({k: v for k, v in e.items() if is_secret_name(k)})
            for k in secrets:
                e.pop(k, None)
        if self.mode == "function":
            return run_id, self._function_plan(per_rank, gpu, secrets, processes), secrets, per_rank
        image = d.image_definition(self.opts, self.workdir)
        command = replica_command(processes)
        sandboxes = []
        for r in chosen:
            tags = {RUN_TAG: run_id, RANK_TAG: str(r), ATTEMPT_TAG: str(attempt)}
            sandboxes.append(d.sandbox_request(
                opts=self.opts, command=command, name=d.sandbox_name(run_id, r, attempt), tags=tags, gpu=gpu,
                timeout=timeout, env=redact_env(per_rank[r]), secret_names=sorted(secrets),
                workdir_shipped="workdir" in image))
        return run_id, {"mode": "sandbox", "app": self.opts.app_name, "environment": self.opts.environment,
                        "image": image, "sandboxes": sandboxes}, secrets, per_rank

    def _function_plan(self, per_rank, gpu, secrets, processes) -> dict[str, Any]:
        if gpu:
            raise UserError(f"function mode: the GPU is set by your @app.function(gpu=...), not the spec; remove "
                            f"`gpu = {gpu!r}` (and set processes_per_replica to the function's GPU count)")
        spawns = [{"rank": r, "diloco_env": redact_env(e), "processes_per_replica": processes,
                   "diloco_secrets": {k: REDACTED for k in sorted(secrets)}} for r, e in per_rank.items()]
        return {"mode": "function", "function": self.function_ref, "deploy": self.deploy,
                "environment": self.opts.environment, "spawn": spawns}

    def dryrun(self, n_replicas, entrypoint, entrypoint_args=None, *, gpu=None, timeout=3600, run_id=None,
               rendezvous=None, ranks=None, attempt=0, env=None, secret_env=None,
               processes_per_replica=1) -> LaunchPlan:
        _, request, _, _ = self._plan(n_replicas, entrypoint, entrypoint_args, gpu=gpu, timeout=timeout,
                                   run_id=run_id, rendezvous=rendezvous, ranks=ranks, attempt=attempt, env=env,
                                   secret_env=secret_env, processes=processes_per_replica)
        return LaunchPlan(self.backend_name, request, format="json")

    # -- launching -----------------------------------------------------------------------------

    def launch_replicas(self, n_replicas, entrypoint, entrypoint_args=None, *, gpu=None, timeout=3600,
                        run_id=None, rendezvous=None, ranks=None, attempt=0, env=None, secret_env=None,
                        processes_per_replica=1) -> list[ReplicaHandle]:
        run_id, request, secrets, full_env = self._plan(
            n_replicas, entrypoint, entrypoint_args, gpu=gpu, timeout=timeout, run_id=run_id,
            rendezvous=rendezvous, ranks=ranks, attempt=attempt, env=env, secret_env=secret_env,
            processes=processes_per_replica)
        if self.mode == "function":
            starts = self._spawner(request, full_env, secrets)
        else:
            starts = self._sandbox_creator(request, full_env, secrets)
        handles: list[ReplicaHandle] = []
        for i, rank in enumerate(full_env):
            try:
                oid = starts(i, rank)
            except (UserError, BackendError) as exc:
                for h in handles:
                    self.cancel(h)
                started = f"; the {len(handles)} replica(s) already started were cancelled" if handles else ""
                raise type(exc)(f"launching rank {rank} on Modal failed: {exc}{started}") from None
            handles.append(ReplicaHandle(rank, self.backend_name, {
                "run_id": run_id, "attempt": attempt, "mode": self.mode, "id": oid,
                "app": self.opts.app_name if self.mode == "sandbox" else self.function_ref,
                "url": dashboard_url(oid)}))
        return handles

    def _sandbox_creator(self, request, full_env, secrets):
        modal = _sdk()
        app = self._call(f"look up app {self.opts.app_name!r}", modal.App.lookup, self.opts.app_name,
                         create_if_missing=True, environment_name=self.opts.environment)
        image = d.build_image(modal, request["image"])
        attached = [modal.Secret.from_name(n, environment_name=self.opts.environment) for n in self.opts.secrets]
        if secrets:
            attached.append(modal.Secret.from_dict(secrets))  # values reach Modal only, never a record
        by_rank = {int(req["tags"][RANK_TAG]): req for req in request["sandboxes"]}

        def create(_i: int, rank: int) -> str:
            req = by_rank[rank]
            kwargs = {k: req[k] for k in ("name", "tags", "gpu", "timeout", "workdir", "cpu", "memory", "region",
                                          "cloud") if req.get(k) is not None}
            sb = self._call(f"create the sandbox for rank {rank}", modal.Sandbox.create, *req["command"], app=app,
                            image=image, env=full_env[rank], secrets=attached,
                            volumes=d.build_mounts(modal, req, self.opts.environment), **kwargs)
            self._objects[sb.object_id] = sb
            return sb.object_id
        return create

    def _function(self) -> Any:
        modal = _sdk()
        if self._function_obj is not None:
            if self.deploy:
                raise UserError("deploy = true needs `function` as 'module:function' (its module's app is deployed); "
                                "with a function object, deploy its app yourself (app.deploy())")
            return self._function_obj
        ref = self.function_ref or ""
        if "/" in ref and ":" not in ref:
            app_name, _, name = ref.partition("/")
            return self._call(f"look up function {ref!r}", modal.Function.from_name, app_name, name,
                              environment_name=self.opts.environment)
        module_name, _, attr = ref.partition(":")
        if self.workdir and self.workdir not in sys.path:
            sys.path.insert(0, self.workdir)
        try:
            module = importlib.import_module(module_name)
            fn = module
            for part in attr.split("."):
                fn = getattr(fn, part)
        except (ImportError, AttributeError) as exc:
            raise UserError(f"[backend] function {ref!r}: {exc}") from None
        if not (hasattr(fn, "spawn") and hasattr(fn, "remote")):
            raise UserError(f"[backend] function {ref!r} is a {type(fn).__name__}, not a Modal function: decorate it "
                            f"with @app.function(...)")
        if self.deploy:
            apps = [v for v in vars(module).values() if isinstance(v, modal.App)]
            if len(apps) != 1:
                raise UserError(f"[backend] deploy = true: module {module_name!r} must define exactly one modal.App "
                                f"(found {len(apps)})")
            self._call(f"deploy app {apps[0].name!r}", apps[0].deploy, environment_name=self.opts.environment)
        return fn

    def _spawner(self, request, full_env, secrets):
        fn = self._function()
        processes = request["spawn"][0]["processes_per_replica"] if request["spawn"] else 1

        def spawn(_i: int, rank: int) -> str:
            call = self._call(f"spawn rank {rank}", fn.spawn, rank=rank, diloco_env=full_env[rank],
                              processes_per_replica=processes, diloco_secrets=secrets)
            self._objects[call.object_id] = call
            return call.object_id
        return spawn

    # -- observing -----------------------------------------------------------------------------

    def poll(self, handle: ReplicaHandle) -> ReplicaStatus:
        md = dict(handle.metadata)
        obj = self._object(md)
        if md["mode"] == "sandbox":
            code = self._call(f"poll {md['id']}", obj.poll)
            if code is None:
                return ReplicaStatus.RUNNING
            if code == 0:
                return ReplicaStatus.SUCCEEDED
            tags = self._call(f"read the tags of {md['id']}", obj.get_tags)
            return ReplicaStatus.CANCELLED if tags.get(d.CANCEL_TAG) else ReplicaStatus.FAILED
        return _call_status(self._call(f"poll {md['id']}", obj.get_call_graph), md["id"])

    def stream_logs(self, handle: ReplicaHandle, *, n_lines: int = 200) -> str:
        md = dict(handle.metadata)
        obj = self._object(md)
        entries = self._call(f"read the logs of {md['id']}", lambda: list(obj.logs.tail(n_lines)))
        text = "".join(e.message if e.message.endswith("\n") else e.message + "\n" for e in entries)
        lines = text.splitlines()[-n_lines:]
        if not lines:
            return f"(no output yet from {md['id']}; {md.get('url') or dashboard_url(md['id'])})\n"
        return "\n".join(lines) + "\n"

    def collect(self, handles: Sequence[ReplicaHandle], *, timeout: float | None = None) -> list[ReplicaResult]:
        statuses = poll_until_terminal(self, handles, timeout=timeout, interval=0.5)
        return [self._result(h, s) for h, s in zip(handles, statuses)]

    def _result(self, handle: ReplicaHandle, status: ReplicaStatus) -> ReplicaResult:
        done = unless_failed(handle, status, lambda n: self.stream_logs(handle, n_lines=n))
        if done is not None:
            return done
        md = dict(handle.metadata)
        tail = self.stream_logs(handle, n_lines=20).strip()
        if md["mode"] == "sandbox":
            code = self._call(f"poll {md['id']}", self._object(md).poll)
        else:
            code = _exit_code_in(tail)
        first = cause_from_log(tail) or _exit_cause(code, md["id"])
        error = f"{first}\n{md.get('url') or dashboard_url(md['id'])}\n{tail}".rstrip()
        return ReplicaResult(handle.rank, status, code if code is not None else 1, error, None, handle.attempt)

    # -- stopping ------------------------------------------------------------------------------

    def cancel(self, handle: ReplicaHandle) -> None:
        """Terminate the sandbox (tagged as cancelled first, so any shell reads it as such) or
        cancel the call with its containers. A replica that already ended keeps its status."""
        md = dict(handle.metadata)
        if self.poll(handle).is_terminal:
            return
        obj = self._object(md)
        if md["mode"] == "sandbox":
            tags = self._call(f"read the tags of {md['id']}", obj.get_tags)
            self._call(f"tag {md['id']}", obj.set_tags, {**tags, d.CANCEL_TAG: "1"})
            self._call(f"terminate {md['id']}", obj.terminate)
        else:
            self._call(f"cancel {md['id']}", obj.cancel, terminate_containers=True)


def _call_status(graph: list[Any], call_id: str) -> ReplicaStatus:
    """A function call's status from its call graph (status only: no result is fetched)."""
    mine = [i for i in graph if getattr(i, "function_call_id", None) == call_id] or list(graph)
    if not mine:  # Modal keeps inputs for a limited time: the call's record is gone
        return ReplicaStatus.FAILED
    info = mine[0]
    name = getattr(info.status, "name", str(info.status))
    if name == "PENDING":
        return ReplicaStatus.RUNNING if info.task_id else ReplicaStatus.PENDING
    return {"SUCCESS": ReplicaStatus.SUCCEEDED, "TERMINATED": ReplicaStatus.CANCELLED}.get(name, ReplicaStatus.FAILED)


def _exit_code_in(tail: str) -> int | None:
    """run_replica's failure ends "(exit code N)"; the call's logs carry it."""
    import re

    found = re.findall(r"\(exit code (-?\d+)\)", tail)
    return int(found[-1]) if found else None


def _exit_cause(code: int | None, object_id: str) -> str:
    """The cause first (the rule in `diloco.failures`) when the replica printed none."""
    if code == 124:
        return f"{object_id} timed out (exit code 124)"
    killed = signal_cause(code)
    if killed:
        return killed
    return f"{object_id} exited with code {code}" if code is not None else f"{object_id} failed"
