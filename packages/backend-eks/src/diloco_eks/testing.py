"""A Kubernetes stand-in for tests: kmock's API emulator plus a tiny Job controller and kubelet.

kmock's `KubernetesEmulator` serves a stateful Kubernetes API on a real loopback port (the real
kubernetes client talks to it over HTTP) but runs no controllers. `SimulatedCluster` adds the
two this backend relies on, driven through the same client against the same API:

- Job controller: creates each Indexed Job's pods (named ``<job>-<index>-<5 chars>``, with the
  completion-index annotation and label), keeps ``active``, ``completedIndexes``,
  ``failedIndexes`` and the Complete/Failed conditions, honours ``backoffLimitPerIndex`` and
  ``backoffLimit: 0``, and deletes pods of deleted Jobs;
- kubelet: runs each pod's command as a local process (in its own process group) with the env
  the pod spec declares — literal values, the downward-API completion index, Secret keys — and
  nothing of the test process's own environment beyond what a node's image would have (PATH,
  HOME, locale): no AWS_* or DILOCO_* leaks in, so a pod reaches the store only as the spec says;
  records exit codes in the pod status, and serves ``pods/log`` from the process output.

Images are not pulled; an image whose name contains ``does-not-exist`` reports ErrImagePull.
Requires the ``testing`` extra (kmock, pytest-asyncio).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .manifest import COMPLETION_INDEX_ANNOTATION
from .status import format_indexes


class _Pod:
    def __init__(self, ns: str, name: str, job: str, index: int, proc: subprocess.Popen | None, log: Path):
        self.ns, self.name, self.job, self.index, self.proc, self.log = ns, name, job, index, proc, log
        self.exit_code: int | None = None


class SimulatedCluster:
    def __init__(self, workdir: str | Path, *, interval: float = 0.1, extra_pythonpath: list[str] | None = None):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.interval = interval
        self.extra_pythonpath = list(extra_pythonpath or [])
        self.url = ""
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._pods: dict[tuple[str, str], _Pod] = {}
        self._jobs: dict[tuple[str, str], dict[str, Any]] = {}
        self._failures: dict[tuple[str, str, int], int] = {}
        self.emulator: Any = None
        self._threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []
        self.error_traces: list[str] = []
        self._stop_control = threading.Event()

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> SimulatedCluster:
        server = threading.Thread(target=self._serve, name="kmock", daemon=True)
        server.start()
        if not self._ready.wait(30):
            raise RuntimeError("the Kubernetes emulator did not start")
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.url
        self.api = client.ApiClient(cfg)
        self.core, self.batch = client.CoreV1Api(self.api), client.BatchV1Api(self.api)
        controller = threading.Thread(target=self._control, name="job-controller", daemon=True)
        controller.start()
        self._threads = [server, controller]
        return self

    def __exit__(self, *exc: object) -> None:
        # the controller first, the API server last: a reconcile still running when the server
        # stopped met "connection refused" and was reported as the test's error
        self._stop_control.set()
        server, controller = self._threads
        controller.join(timeout=10)
        for pod in list(self._pods.values()):
            self._kill(pod, signal.SIGKILL)
        self._stop.set()
        server.join(timeout=10)

    def _serve(self) -> None:
        import kmock
        from kmock._internal import apps

        async def main() -> None:
            async with kmock.KubernetesEmulator() as k8s, apps.Server(k8s) as srv:
                k8s[kmock.subresource("log")] << self._serve_log
                self.emulator = k8s
                self.url = f"http://127.0.0.1:{srv.port}"
                self._ready.set()
                while not self._stop.is_set():
                    await asyncio.sleep(0.05)

        asyncio.run(main())

    def _serve_log(self, request: Any) -> bytes:
        pod = self._pods.get((request.namespace, request.name))
        if pod is None or not pod.log.exists():
            return b""
        lines = pod.log.read_text(errors="replace").splitlines()
        tail = int(dict(request.params).get("tailLines") or len(lines) or 1)
        return ("\n".join(lines[-tail:]) + ("\n" if lines else "")).encode()  # bytes: served as text, not JSON

    # -- helpers for tests -------------------------------------------------------------------

    def pods_of(self, job: str) -> list[_Pod]:
        return [p for p in self._pods.values() if p.job == job]

    def kill_pod(self, job: str, index: int, sig: int = signal.SIGKILL) -> bool:
        """Kill the running process of `job`'s pod for `index` (a crashed or OOM-killed pod)."""
        for pod in self.pods_of(job):
            if pod.index == index and pod.proc is not None and pod.proc.poll() is None:
                os.killpg(pod.proc.pid, sig)
                return True
        return False

    def live_processes(self) -> list[int]:
        return [p.proc.pid for p in self._pods.values() if p.proc is not None and p.proc.poll() is None]

    # -- the controller loop -----------------------------------------------------------------

    def _control(self) -> None:
        while not self._stop_control.is_set():
            try:
                self._reconcile()
            except Exception as exc:  # keep controlling; surface in the test's teardown if asserted
                import traceback

                self.errors.append(exc)
                self.error_traces.append(traceback.format_exc())
            time.sleep(self.interval)

    def _json(self, fn, *args, **kwargs) -> Any:
        return json.loads(fn(*args, _preload_content=False, **kwargs).data)

    def _reconcile(self) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            items = self._json(self.batch.list_job_for_all_namespaces).get("items", [])
        except ApiException as exc:
            if exc.status != 404:  # the emulator knows no Jobs until the first one is created
                raise
            items = []
        jobs = {(j["metadata"]["namespace"], j["metadata"]["name"]): j for j in items}
        for key in list(self._jobs):
            if key not in jobs:  # deleted: background propagation removes its pods
                for pod in [p for p in self._pods.values() if (p.ns, p.job) == key]:
                    self._kill(pod, signal.SIGTERM)
                    self._delete_pod(pod)
                del self._jobs[key]
        for key, job in jobs.items():
            if key not in self._jobs:
                self._jobs[key] = job
                for index in range(int(job["spec"].get("completions") or 1)):
                    self._start_pod(job, index)
            self._update_job(key, job)

    def _start_pod(self, job: dict[str, Any], index: int) -> None:
        ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
        template = job["spec"]["template"]
        container = template["spec"]["containers"][0]
        pod_name = f"{name}-{index}-{secrets.token_hex(3)[:5]}"
        labels = {**(template.get("metadata", {}).get("labels") or {}), "job-name": name,
                  COMPLETION_INDEX_ANNOTATION: str(index)}
        annotations = {COMPLETION_INDEX_ANNOTATION: str(index)}
        manifest = {"apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": pod_name, "namespace": ns, "labels": labels, "annotations": annotations,
                                 "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": name,
                                                      "uid": job["metadata"].get("uid", "")}]},
                    "spec": template["spec"]}
        self.core.create_namespaced_pod(ns, manifest, _preload_content=False)
        log = self.workdir / f"{pod_name}.log"
        if "does-not-exist" in container.get("image", ""):
            self._pods[(ns, pod_name)] = _Pod(ns, pod_name, name, index, None, log)
            self.core.patch_namespaced_pod_status(pod_name, ns, {"status": {"phase": "Pending", "containerStatuses": [
                {"name": container["name"], "image": container["image"], "imageID": "", "ready": False,
                 "restartCount": 0, "state": {"waiting": {
                     "reason": "ErrImagePull", "message": f"failed to pull image {container['image']!r}: not found"}}}]}},
                _preload_content=False)
            return
        env = {**_node_env(), **self._resolve_env(ns, container.get("env") or [], annotations)}
        env["PYTHONPATH"] = os.pathsep.join([*self.extra_pythonpath, env.get("PYTHONPATH", "")]).strip(os.pathsep)
        cmd = list(container.get("command") or ["diloco-replica"]) + list(container.get("args") or [])
        if cmd[0] in ("python", "python3"):
            cmd[0] = sys.executable
        elif cmd[0] == "diloco-replica":
            cmd = [sys.executable, "-m", "diloco_replica", *cmd[1:]]
        with open(log, "ab") as out:
            proc = subprocess.Popen(cmd, env=env, cwd=self.workdir, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self._pods[(ns, pod_name)] = _Pod(ns, pod_name, name, index, proc, log)
        self.core.patch_namespaced_pod_status(pod_name, ns, {"status": {"phase": "Running", "containerStatuses": [
            {"name": container["name"], "image": container["image"], "imageID": f"sha256:{secrets.token_hex(8)}",
             "ready": True, "restartCount": 0, "state": {"running": {"startedAt": _now()}}}]}},
            _preload_content=False)

    def _resolve_env(self, ns: str, env: list[dict[str, Any]], annotations: dict[str, str]) -> dict[str, str]:
        out = {}
        for item in env:
            if "value" in item:
                out[item["name"]] = str(item["value"])
                continue
            source = item.get("valueFrom") or {}
            if "fieldRef" in source:
                path = source["fieldRef"]["fieldPath"]
                key = path.split("['", 1)[1].rstrip("']") if "['" in path else path
                out[item["name"]] = annotations.get(key, "")
            elif "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                secret = self._json(self.core.read_namespaced_secret, ref["name"], ns)
                if ref["key"] in (secret.get("stringData") or {}):
                    out[item["name"]] = secret["stringData"][ref["key"]]
                else:
                    out[item["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
        return out

    def _update_job(self, key: tuple[str, str], job: dict[str, Any]) -> None:
        ns, name = key
        spec = job["spec"]
        completions = int(spec.get("completions") or 1)
        per_index_limit = spec.get("backoffLimitPerIndex")
        pods = [p for p in self._pods.values() if (p.ns, p.job) == key]
        done, failed = set(), set()
        for pod in pods:
            if pod.proc is not None and pod.exit_code is None and pod.proc.poll() is not None:
                pod.exit_code = pod.proc.returncode
                code = pod.exit_code if pod.exit_code >= 0 else 128 - pod.exit_code
                image = job["spec"]["template"]["spec"]["containers"][0].get("image", "")
                self.core.patch_namespaced_pod_status(pod.name, ns, {"status": {
                    "phase": "Succeeded" if code == 0 else "Failed",
                    "containerStatuses": [{"name": "replica", "image": image, "imageID": "", "ready": False,
                                           "restartCount": 0, "state": {"terminated": {
                                               "exitCode": code, "reason": "Completed" if code == 0 else "Error",
                                               "finishedAt": _now()}}}]}}, _preload_content=False)
                if code != 0:
                    count = self._failures[(ns, name, pod.index)] = self._failures.get((ns, name, pod.index), 0) + 1
                    if per_index_limit is not None and count <= int(per_index_limit):
                        self._start_pod(job, pod.index)  # retried in place by Kubernetes
        pods = [p for p in self._pods.values() if (p.ns, p.job) == key]
        for index in range(completions):
            mine = [p for p in pods if p.index == index]
            if any(p.exit_code == 0 for p in mine):
                done.add(index)
            elif mine and all(p.exit_code not in (None, 0) for p in mine) and (
                    per_index_limit is None or self._failures.get((ns, name, index), 0) > int(per_index_limit)):
                failed.add(index)
        active = sum(1 for p in pods if p.exit_code is None)
        conditions = []
        if failed and per_index_limit is None:  # backoffLimit 0: the first failure fails the Job
            conditions.append({"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                               "message": "Job has reached the specified backoff limit"})
            for pod in pods:
                if pod.exit_code is None:
                    self._kill(pod, signal.SIGTERM)
        elif len(done) + len(failed) == completions:
            conditions.append({"type": "Failed", "status": "True", "reason": "FailedIndexes",
                               "message": "Job has failed indexes"} if failed else
                              {"type": "Complete", "status": "True"})
        status = {"active": active, "succeeded": len(done), "failed": len(failed),
                  "completedIndexes": format_indexes(done), "failedIndexes": format_indexes(failed) or None,
                  "conditions": conditions or None}
        if status != self._jobs[key].get("_last_status"):
            from kubernetes.client.exceptions import ApiException

            self._jobs[key]["_last_status"] = status
            try:
                self.batch.patch_namespaced_job_status(name, ns, {"status": status}, _preload_content=False)
            except ApiException as exc:
                if exc.status != 404:  # deleted since this pass listed it: the next pass removes its pods
                    raise

    def _kill(self, pod: _Pod, sig: int) -> None:
        if pod.proc is not None and pod.proc.poll() is None:
            try:
                os.killpg(pod.proc.pid, sig)
            except ProcessLookupError:
                pass
            if sig == signal.SIGTERM:
                try:
                    pod.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    os.killpg(pod.proc.pid, signal.SIGKILL)

    def _delete_pod(self, pod: _Pod) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self.core.delete_namespaced_pod(pod.name, pod.ns, _preload_content=False)
        except ApiException as exc:
            if exc.status != 404:
                raise
        self._pods.pop((pod.ns, pod.name), None)


_NODE_VARS = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "VIRTUAL_ENV")


def _node_env() -> dict[str, str]:
    """What a container starts with before the pod spec's env: the image's basics, nothing of the test's."""
    return {k: os.environ[k] for k in _NODE_VARS if k in os.environ}


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
