"""`SimulatedCluster`: the strict API server on a loopback port plus the controllers a cluster runs.

The API server (`apiserver.StrictApiServer`, kmock underneath) runs in its own thread and event
loop; the real kubernetes client talks to it over HTTP. One control thread then does, every
`interval` seconds and only through that same API, what a cluster's control plane and node do:

- the garbage collector: a pod, Secret or Service whose owning Job is gone (checked with a live
  GET of the owner, as the real collector does) is deleted; a Job deleted with
  `propagationPolicy: Orphan` (a Job's default) first has its dependents' owner references
  removed, so they stay;
- the cluster's DNS (`dns`): the records of headless Services' pods, which the kubelet gives
  each pod as its /etc/hosts;
- the Job controller (`jobcontroller`) and the kubelet (`kubelet`).

Errors in that loop, and every request the stand-in answered 501 Not Implemented, end up in
`error_traces`, which the test fixtures assert empty.
"""

from __future__ import annotations

import asyncio
import json
import queue
import signal
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import kmock

from . import dns, services
from .apiserver import StrictApiServer
from .protocol import HttpServer
from .jobcontroller import JobController, unsupported_job
from .kubelet import Kubelet, LocalPod

# what the kubelet can run: env sources and volume types it implements
_ENV_SOURCES = {"fieldRef", "secretKeyRef"}
_POD_FIELDS_NOT_RUN = ("initContainers", "ephemeralContainers", "readinessGates", "resourceClaims", "schedulingGates",
                       "hostAliases", "hostNetwork", "setHostnameAsFQDN", "dnsConfig")
_CONTAINER_FIELDS_NOT_RUN = ("envFrom", "livenessProbe", "readinessProbe", "startupProbe", "lifecycle", "workingDir",
                             "stdin", "tty", "volumeDevices")


class SimulatedCluster:
    """A Kubernetes 1.29 stand-in: `url` for `api_url`, `core`/`batch` clients for tests.

    `namespaces`: the namespaces that exist (creating in another is 404, as on a cluster);
    None: every namespace exists.
    """

    def __init__(self, workdir: str | Path, *, interval: float = 0.1, extra_pythonpath: list[str] | None = None,
                 namespaces: list[str] | None = None):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.interval = interval
        self.extra_pythonpath = list(extra_pythonpath or [])
        self.namespaces = None if namespaces is None else {"default", *namespaces}
        self.url = ""
        self.emulator: StrictApiServer | None = None
        self.errors: list[BaseException] = []
        self._traces: list[str] = []
        self._orphaned: set[str] = set()  # uids of owners deleted with Orphan propagation
        self._orphan_queue: queue.Queue[str] = queue.Queue()
        self._stop_server, self._stop_control, self._ready = threading.Event(), threading.Event(), threading.Event()
        self._threads: list[threading.Thread] = []

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> SimulatedCluster:
        server = threading.Thread(target=self._serve, name="kube-apiserver", daemon=True)
        server.start()
        if not self._ready.wait(30):
            raise RuntimeError("the Kubernetes stand-in's API server did not start")
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.url
        self.api = client.ApiClient(cfg)
        self.core, self.batch = client.CoreV1Api(self.api), client.BatchV1Api(self.api)
        self.kubelet = Kubelet(self.core, self.workdir, self.extra_pythonpath)
        self.jobs = JobController(self.core, self.batch)
        control = threading.Thread(target=self._control, name="control-plane", daemon=True)
        control.start()
        self._threads = [server, control]
        return self

    def __exit__(self, *exc: object) -> None:
        # the control loop first, the API server last: a pass still running when the server
        # stopped would meet "connection refused" and be reported as the test's error
        self._stop_control.set()
        server, control = self._threads
        control.join(timeout=30)
        for pod in list(self.kubelet.pods.values()):
            self.kubelet.stop(pod, signal.SIGKILL)
        self._stop_server.set()
        server.join(timeout=10)

    def _serve(self) -> None:
        async def main() -> None:
            api = StrictApiServer(can_run=_unsupported, on_delete=self._deleted, pod_log=self._pod_log,
                                  namespaces=self.namespaces)
            async with api, kmock.Server(api, server_cls=HttpServer) as srv:
                self.emulator = api
                self.url = f"http://127.0.0.1:{srv.port}"
                self._ready.set()
                while not self._stop_server.is_set():
                    await asyncio.sleep(0.05)

        asyncio.run(main())

    def _pod_log(self, ns: str, name: str, tail: int | None) -> str | None:
        return self.kubelet.log(ns, name, tail)

    def _deleted(self, kind: str, obj: dict[str, Any], policy: str) -> None:
        """Called by the API server as it deletes `obj` (in its thread): orphans are remembered
        at once, before the collector could see them without their owner."""
        if policy == "Orphan":
            self._orphaned.add(obj["metadata"]["uid"])
            self._orphan_queue.put(obj["metadata"]["uid"])

    # -- helpers for tests -------------------------------------------------------------------

    @property
    def error_traces(self) -> list[str]:
        """The control loop's errors and the requests answered 501: a test's teardown asserts none."""
        return self._traces + [f"501 {m}" for m in (self.emulator.unimplemented if self.emulator else [])]

    @property
    def unimplemented(self) -> list[str]:
        return self.emulator.unimplemented

    def deny(self, verb: str, plural: str, namespace: str) -> None:
        """Answer `verb` on `plural` in `namespace` with 403 Forbidden (a missing RBAC grant)."""
        self.emulator.deny(verb, plural, namespace)

    def pods_of(self, job: str) -> list[LocalPod]:
        return [p for p in self.kubelet.pods.values() if p.job == job]

    def kill_pod(self, job: str, index: int, sig: int = signal.SIGKILL) -> bool:
        """Kill the running process of `job`'s pod for `index` (a crashed or OOM-killed container)."""
        import os

        for pod in self.pods_of(job):
            if pod.index == index and pod.proc is not None and pod.proc.poll() is None:
                os.killpg(pod.proc.pid, sig)
                return True
        return False

    def live_processes(self) -> list[int]:
        return [p.proc.pid for p in self.kubelet.pods.values() if p.proc is not None and p.proc.poll() is None]

    # -- the control loop --------------------------------------------------------------------

    def _control(self) -> None:
        while not self._stop_control.is_set():
            try:
                self._reconcile()
            except Exception as exc:  # keep controlling; the test's teardown asserts none happened
                self.errors.append(exc)
                self._traces.append(traceback.format_exc())
            time.sleep(self.interval)

    def _list(self, fn: Any) -> list[dict[str, Any]]:
        return json.loads(fn(_preload_content=False).data).get("items", [])

    def _reconcile(self) -> None:
        self._strip_orphans()
        jobs = self._list(self.batch.list_job_for_all_namespaces)
        pods = self._list(self.core.list_pod_for_all_namespaces)
        live_owners = {j["metadata"]["uid"] for j in jobs}
        pods = [p for p in pods if not self._collect(p, live_owners, self.core.delete_namespaced_pod)]
        for secret in self._list(self.core.list_secret_for_all_namespaces):
            self._collect(secret, live_owners, self.core.delete_namespaced_secret)
        svcs = [s for s in self._list(self.core.list_service_for_all_namespaces)
                if not self._collect(s, live_owners, self.core.delete_namespaced_service)]
        self.kubelet.sync(pods, dns.records(svcs, pods))
        for job in jobs:
            self.jobs.sync(job, pods)

    def _strip_orphans(self) -> None:
        """Orphan propagation: the dependents lose their reference to the deleted owner."""
        while not self._orphan_queue.empty():
            uid = self._orphan_queue.get()
            patch = {"metadata": {"ownerReferences": [{"$patch": "delete", "uid": uid}]}}
            for objs, fn in ((self.core.list_pod_for_all_namespaces, self.core.patch_namespaced_pod),
                             (self.core.list_secret_for_all_namespaces, self.core.patch_namespaced_secret),
                             (self.core.list_service_for_all_namespaces, self.core.patch_namespaced_service)):
                for obj in self._list(objs):
                    if any(r.get("uid") == uid for r in obj["metadata"].get("ownerReferences") or []):
                        fn(obj["metadata"]["name"], obj["metadata"]["namespace"], patch, _preload_content=False)

    def _collect(self, obj: dict[str, Any], live_owners: set[str], delete: Any) -> bool:
        """Delete `obj` if every Job that owns it is gone (confirmed by a live GET); True if deleted."""
        from kubernetes.client.exceptions import ApiException

        meta = obj["metadata"]
        owners = [r for r in meta.get("ownerReferences") or [] if (r.get("apiVersion"), r.get("kind")) ==
                  ("batch/v1", "Job")]
        if not owners or any(r["uid"] in live_owners or r["uid"] in self._orphaned for r in owners):
            return False
        for ref in owners:
            try:
                owner = json.loads(self.batch.read_namespaced_job(ref["name"], meta["namespace"],
                                                                  _preload_content=False).data)
                if owner["metadata"]["uid"] == ref["uid"]:
                    return False  # created after this pass listed the Jobs
            except ApiException as exc:
                if exc.status != 404:
                    raise
        try:
            delete(meta["name"], meta["namespace"], _preload_content=False)
        except ApiException as exc:
            if exc.status != 404:
                raise
        return True


def _unsupported(kind: str, obj: dict[str, Any]) -> str | None:
    """What the simulated controllers and kubelet would not run as a cluster does (answered 501)."""
    if kind == "Service":
        return services.unsupported(obj)
    if kind == "Secret":
        kind_of_secret = obj.get("type") or "Opaque"
        if "kubernetes.io/" in kind_of_secret:
            return f"Secrets of type {kind_of_secret} (their per-type rules)"
        return None
    if kind == "Job":
        problem = unsupported_job(obj)
        if problem:
            return problem
        spec = obj["spec"]["template"]["spec"]
    else:
        spec = obj["spec"]
    for key in _POD_FIELDS_NOT_RUN:
        if spec.get(key):
            return f"the simulated kubelet does not implement pod spec.{key}"
    if len(spec.get("containers") or []) != 1:
        return "the simulated kubelet runs pods of exactly one container"
    container = spec["containers"][0]
    for key in _CONTAINER_FIELDS_NOT_RUN:
        if container.get(key):
            return f"the simulated kubelet does not implement containers[].{key}"
    for var in container.get("env") or []:
        source = set(var.get("valueFrom") or {}) - _ENV_SOURCES
        if source:
            return f"the simulated kubelet does not resolve env valueFrom.{sorted(source)[0]}"
    for volume in spec.get("volumes") or []:
        if set(volume) - {"name", "emptyDir"}:
            return "the simulated kubelet accepts emptyDir volumes only (it mounts nothing: pods share its disk)"
    return None
