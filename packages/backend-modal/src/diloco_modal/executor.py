"""ModalExecutor: replicas as Modal sandboxes built from the spec, or calls of your own Modal function.

Two modes, one executor:

- **Sandbox mode** (default): from the spec alone (gpu, an image or debian_slim with the
  launcher's own diloco as wheels (`wheels`) + pip, the workdir's shipped files, forwarded and
  named secrets, volumes, bucket mounts, timeout, region, cloud)
  each replica attempt is one `modal.Sandbox` running the replica command every backend runs
  (`diloco.procgroup.replica_command`: the runner, or torchrun over L processes). Sandboxes,
  not functions, because a sandbox is a process: it has an exit code (so a config error, a
  preemption or an OOM kill reads as such), its own logs, tags (run, rank, attempt), `from_id`
  for durable handles, and `terminate`; and nothing has to be deployed first.
- **Function mode** (`[backend] function = "module:fn"` or `"app-name/fn-name"`): the user owns
  the `@app.function` (image, GPU, volumes, secrets, timeout); each replica is `fn.spawn(rank=i,
  diloco_env=..., processes_per_replica=L)` (sent as CBOR, not pickle), whose body calls
  `diloco_modal.run_replica`. The spec's forwarded `secrets` are one ephemeral Modal secret
  attached with `fn.with_options(secrets=[the function's own..., that one])`, never the call's
  input, which Modal keeps for the call's lifetime (`functions`). A call's status is its output
  record (`calls`), never `get()`, and never the best-effort call graph alone. A replica of
  `nodes = K` machines is one call of a function decorated with `@modal.clustered(size=K)`: Modal
  starts its K containers together and each runs its node of the replica (`cluster`); the call
  is the replica's one attempt, ended by Modal when one of its containers fails.

`plan` builds the body (`diloco_modal.plans`) and `submit` hands exactly that to Modal, adding
the secret values only there, as Modal secrets in both modes. Durable handles hold only ids
(`sb-…`, `fc-…`), rebuilt with `Sandbox.from_id` / `FunctionCall.from_id`, so `diloco
status/logs/cancel/resume` work from any shell after the launcher is gone; a handle read back
from a record is checked first (`_metadata`). How a replica ended is read in `results`, its
output lines in `logtail` (Modal's log entries are chunks, not lines).

modal is imported on first use, never at import or for a plan of sandbox mode.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import tempfile
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from diloco.errors import UserError
from diloco.options import options_from
from diloco.protocol import Capabilities, ReplicaHandle, ReplicaResult, ReplicaStatus
from diloco.request import LaunchPlan, LaunchRequest
from diloco.submitting import start_each
from diloco.waiting import collect_results

from . import calls, logtail, results, wheels
from . import definition as d
from .functions import check_given, check_ref, function_ref, lookup_of, resolve_function, with_forwarded_secrets
from .options import ModalOptions
from .plans import PREEMPTION_SIGNAL, RANK_TAG, function_plan, sandbox_plan
from .sdk import call, dashboard_url, sdk


class ModalExecutor:
    """Replicas as Modal Sandboxes (default) or as calls of a Modal Function (`function`).

    `ModalExecutor(ModalOptions(...))` or `ModalExecutor(app_name=..., function=...)`; from Python,
    `function` may be the decorated Modal function itself (kept aside; the options hold its
    'module:qualname'). What is shipped into the containers is the request's `workdir`.
    """

    backend_name = "modal"
    Options = ModalOptions
    capabilities = Capabilities(shares_launcher_filesystem=False, relaunches_one_rank=True, process_groups=True,
                                multi_node=True, inter_replica_network=False, preemption_signal=PREEMPTION_SIGNAL)

    def __init__(self, options: ModalOptions | None = None, /, **overrides: Any):
        self._function_obj = None
        given = overrides.get("function", getattr(options, "function", None))
        if given is not None and not isinstance(given, str):  # from Python: the decorated function itself
            ref = function_ref(given)
            self._function_obj = given
            if "function" in overrides:
                overrides = {**overrides, "function": ref}
            else:
                options = dataclasses.replace(options, function=ref)
        self.options = options_from(type(self), options, overrides)
        if self._function_obj is None:
            check_ref(self.options.function)
        self._objects: dict[str, Any] = {}
        self._wheels: Path | None = None

    def _wheel_dir(self) -> Path:
        """Where this executor builds the launcher's wheels (kept while it lives: the image's
        files are uploaded when the first sandbox is created)."""
        if self._wheels is None:
            self._wheels = Path(tempfile.mkdtemp(prefix="diloco-wheels-"))
            weakref.finalize(self, shutil.rmtree, self._wheels, True)
        return self._wheels

    @property
    def mode(self) -> str:
        return "function" if self.options.function else "sandbox"

    # -- talking to Modal ----------------------------------------------------------------------

    def _call(self, what: str, fn, *args, **kwargs):
        return call(what, self.options.function, fn, *args, **kwargs)

    def _object(self, md: dict[str, Any]) -> Any:
        """The sandbox or function call a handle names, rebuilt from its id (cached per executor)."""
        oid = md["id"]
        if oid not in self._objects:
            modal = sdk()
            cls = modal.Sandbox if md["mode"] == "sandbox" else modal.FunctionCall
            self._objects[oid] = self._call(f"find {oid}", cls.from_id, oid)
        return self._objects[oid]

    # -- planning and submitting ---------------------------------------------------------------

    def plan(self, request: LaunchRequest) -> LaunchPlan:
        """Sandbox mode: the image and each rank's `Sandbox.create`; function mode: each rank's
        `spawn`. Secrets REDACTED; bad GPUs, timeouts, requirements files and a spec GPU in function
        mode fail here (UserError)."""
        check_given(self.options, self._function_obj)
        build = function_plan if self.mode == "function" else sandbox_plan
        return LaunchPlan(self.backend_name, request, build(self.options, request), format="json")

    def submit(self, plan: LaunchPlan) -> list[ReplicaHandle]:
        request, body = plan.request, plan.body
        start = self._spawner(plan) if body["mode"] == "function" else self._sandbox_creator(plan)

        def started(rank: int) -> ReplicaHandle:
            oid = start(rank)
            return ReplicaHandle.of(request, rank, self.backend_name, mode=body["mode"], id=oid,
                                    app=body["app"] if body["mode"] == "sandbox" else body["function"],
                                    url=dashboard_url(oid))
        return start_each(request.ranks, started, self.cancel, platform="Modal")

    def _sandbox_creator(self, plan: LaunchPlan):
        modal, body, env_name = sdk(), plan.body, plan.body["environment"]
        app = self._call(f"look up app {body['app']!r}", modal.App.lookup, body["app"], create_if_missing=True,
                         environment_name=env_name)
        wheel_files = wheels.materialize(body["image"].get("wheels", []), self._wheel_dir())
        image = d.build_image(modal, body["image"], wheel_files)
        values = plan.request.secrets.reveal()
        by_rank = {int(req["tags"][RANK_TAG]): req for req in body["sandboxes"]}

        def create(rank: int) -> str:
            req = by_rank[rank]
            attached = [modal.Secret.from_name(n, environment_name=env_name) for n in req["secrets"]["named"]]
            forwarded = {k: values[k] for k in req["secrets"]["forwarded"]}
            if forwarded:
                attached.append(modal.Secret.from_dict(forwarded))  # values reach Modal only, never a record
            kwargs = {k: req[k] for k in ("name", "tags", "gpu", "timeout", "workdir", "cpu", "memory", "region",
                                          "cloud") if req.get(k) is not None}
            sb = self._call(f"create the sandbox for rank {rank}", modal.Sandbox.create, *req["command"], app=app,
                            image=image, env=req["env"], secrets=attached,
                            volumes=d.build_mounts(modal, req, env_name), **kwargs)
            self._objects[sb.object_id] = sb
            return sb.object_id
        return create

    def _spawner(self, plan: LaunchPlan):
        fn = resolve_function(self.options, self._function_obj, plan.request.workdir, self._call)
        values = plan.request.secrets.reveal()
        forwarded = {k: values[k] for k in plan.body["secrets"]["forwarded"]}
        fn = with_forwarded_secrets(fn, forwarded, lookup_of(self.options, self._function_obj),
                                    plan.body["environment"], self._call)  # a Modal secret, never an input
        by_rank = {row["rank"]: row for row in plan.body["spawn"]}

        def spawn(rank: int) -> str:
            row = by_rank[rank]  # exactly the planned keywords: `nodes` only for a clustered call
            with _cbor_payloads():
                call_ = self._call(f"spawn rank {rank}", fn.spawn, **row)
            self._objects[call_.object_id] = call_
            return call_.object_id
        return spawn

    # -- observing -----------------------------------------------------------------------------

    def poll(self, handle: ReplicaHandle) -> ReplicaStatus:
        md = _metadata(handle)
        obj = self._object(md)
        if md["mode"] == "sandbox":
            code = self._call(f"poll {md['id']}", obj.poll)
            if code is None:
                return ReplicaStatus.RUNNING
            if code == 0:
                return ReplicaStatus.SUCCEEDED
            tags = self._call(f"read the tags of {md['id']}", obj.get_tags)
            return ReplicaStatus.CANCELLED if tags.get(d.CANCEL_TAG) else ReplicaStatus.FAILED
        return self._call(f"poll {md['id']}", calls.outcome, obj).status

    def stream_logs(self, handle: ReplicaHandle, *, n_lines: int = 200) -> str:
        """The last `n_lines` whole lines of output (`logtail`: Modal's entries are raw chunks)."""
        md = _metadata(handle)
        obj = self._object(md)
        text = self._call(f"read the logs of {md['id']}", logtail.tail_text, lambda k: list(obj.logs.tail(k)),
                          n_lines)
        return text or f"(no output yet from {md['id']}; {dashboard_url(md['id'])})\n"

    def collect(self, handles: Sequence[ReplicaHandle], *, timeout: float | None = None) -> list[ReplicaResult]:
        return collect_results(self, handles, timeout=timeout, interval=0.5, failure=self._failure)

    def _failure(self, handle: ReplicaHandle, status: ReplicaStatus) -> ReplicaResult:
        md = _metadata(handle)
        tail = self.stream_logs(handle, n_lines=20).strip()
        said = ""
        if md["mode"] == "sandbox":
            code = self._call(f"poll {md['id']}", self._object(md).poll)
        else:  # from the call's output record (run_replica's exception), never from its log text
            outcome = self._call(f"poll {md['id']}", calls.outcome, self._object(md))
            code, said = outcome.exit_code, outcome.exception
        error = results.failure_error(tail, code, md["id"], dashboard_url(md["id"]), said)
        return ReplicaResult.failed(handle, status, error, code)

    # -- stopping ------------------------------------------------------------------------------

    def cancel(self, handle: ReplicaHandle) -> None:
        """Terminate the sandbox (tagged as cancelled first, so any shell reads it as such) or
        cancel the call with its containers. A replica that already ended keeps its status: a
        sandbox is left alone once it has an exit code; a call is always cancelled (cancelling an
        ended call changes nothing on Modal, and whether it ended is not always known yet)."""
        md = _metadata(handle)
        obj = self._object(md)
        if md["mode"] == "sandbox":
            if self._call(f"poll {md['id']}", obj.poll) is not None:
                return
            tags = self._call(f"read the tags of {md['id']}", obj.get_tags)
            self._call(f"tag {md['id']}", obj.set_tags, {**tags, d.CANCEL_TAG: "1"})
            self._call(f"terminate {md['id']}", obj.terminate)
        else:
            self._call(f"cancel {md['id']}", obj.cancel, terminate_containers=True)


_IDS = {"sandbox": re.compile(r"sb-[A-Za-z0-9][A-Za-z0-9-]{0,62}"),
        "function": re.compile(r"fc-[A-Za-z0-9][A-Za-z0-9-]{0,62}")}


def _metadata(handle: ReplicaHandle) -> dict[str, Any]:
    """A handle's metadata, read back from a run record (a file anyone with the state directory
    can edit), checked before a call is made with it: a known mode and an id of that kind. Its
    `url` is never used: links are rebuilt from the id."""
    md = dict(handle.metadata)
    pattern = _IDS.get(md.get("mode"))  # type: ignore[arg-type]
    oid = md.get("id")
    if pattern is None or not isinstance(oid, str) or not pattern.fullmatch(oid):
        kind = "function call" if md.get("mode") == "function" else "sandbox"
        raise UserError(f"the run record's handle of rank {handle.rank} is not a Modal {kind} "
                        f"(mode {md.get('mode')!r}, id {oid!r}): the record was changed or is not from this backend")
    return md


@contextmanager
def _cbor_payloads() -> Iterator[None]:
    """Spawn inputs as CBOR, not pickle, where the function accepts it (the client falls back to
    pickle for one that does not), unless MODAL_PAYLOAD_FORMAT says otherwise: the container
    then decodes plain data instead of unpickling."""
    if "MODAL_PAYLOAD_FORMAT" in os.environ:
        yield
        return
    os.environ["MODAL_PAYLOAD_FORMAT"] = "cbor"
    try:
        yield
    finally:
        os.environ.pop("MODAL_PAYLOAD_FORMAT", None)
