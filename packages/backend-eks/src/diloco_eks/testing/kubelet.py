"""The simulated kubelet: one node that runs every pod's container as a local process.

It works from the API like a kubelet: a pod that appears is started, a pod that disappears is
stopped (SIGTERM, then SIGKILL after the grace period), an exited process is reported in the
pod's status. The container gets the env its spec declares — literal values, the downward API,
Secret keys read through the API — and of the test process only what a node's image would have
(PATH, HOME, locale): no AWS_* or DILOCO_* leaks in, so a pod reaches the store only as the
spec says. Images are not pulled: a name containing `does-not-exist` stays waiting with
ErrImagePull; a Secret or key that is missing keeps the pod waiting with
CreateContainerConfigError until it appears, as on a node.

Each container runs in mount and UTS namespaces of its own (`unshare`, as root), as in a pod
sandbox: its hostname is the pod's (`spec.hostname`, else its name) and its /etc/hosts is the
file the kubelet writes for it, which also carries the cluster's DNS records (`dns`: the
stand-in's DNS is that file, rewritten in place as records come and go). The network stays the
machine's: every pod's IP is 127.0.0.1, so two pods listening on one port collide as two
`hostNetwork` pods on one node would.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .dns import Record, hosts_file, pod_hostname

NODE_VARS = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "VIRTUAL_ENV")
TERMINATION_GRACE_SECONDS = 5  # shorter than a node's 30: tests wait on it
# the pod sandbox: own mount and UTS namespaces, the pod's hosts file over /etc/hosts, its hostname
SANDBOX = ["unshare", "--mount", "--uts", "--propagation", "private", "sh", "-c",
           'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"', "pod-sandbox"]


class LocalPod:
    """A pod this node runs: its process, log file and what was last reported."""

    def __init__(self, ns: str, name: str, job: str | None, index: int | None, container: dict[str, Any], log: Path):
        self.ns, self.name, self.job, self.index, self.container, self.log = ns, name, job, index, container, log
        self.proc: subprocess.Popen | None = None
        self.exit_code: int | None = None
        self.waiting: str | None = None  # the waiting reason while the container cannot start
        self.started_at = ""
        self.hosts = log.with_suffix(".hosts")
        self.hosts_text = ""


class Kubelet:
    def __init__(self, core: Any, workdir: Path, extra_pythonpath: list[str]):
        self.core, self.workdir, self.extra_pythonpath = core, workdir, extra_pythonpath
        self.pods: dict[tuple[str, str], LocalPod] = {}
        check_sandbox(workdir)


    def sync(self, api_pods: list[dict[str, Any]], dns: Sequence[Record] = ()) -> None:
        live = {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in api_pods}
        for key in [k for k in self.pods if k not in live]:  # deleted through the API
            self.stop(self.pods.pop(key), signal.SIGTERM)
        for key, pod in live.items():
            local = self.pods.get(key)
            if local is None:
                if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                    continue
                local = self.pods[key] = _local(pod, self.workdir)
                self._write_hosts(local, pod, dns)
                self._start(local, pod)
            elif local.proc is None and local.waiting == "CreateContainerConfigError":
                self._start(local, pod)
            elif local.proc is not None and local.exit_code is None and local.proc.poll() is not None:
                self._report_exit(local)
            elif local.proc is not None and local.exit_code is None:
                self._write_hosts(local, pod, dns)

    def log(self, ns: str, name: str, tail: int | None) -> str | None:
        """The container's output (its last `tail` lines); None while it has not started."""
        pod = self.pods.get((ns, name))
        if pod is None or pod.proc is None:
            return None
        lines = pod.log.read_text(errors="replace").splitlines() if pod.log.exists() else []
        lines = lines[-tail:] if tail is not None else lines
        return "\n".join(lines) + ("\n" if lines else "") if tail != 0 else ""

    def stop(self, pod: LocalPod, sig: int) -> None:
        if pod.proc is None or pod.proc.poll() is not None:
            return
        try:
            os.killpg(pod.proc.pid, sig)
        except ProcessLookupError:
            return
        if sig == signal.SIGTERM:
            try:
                pod.proc.wait(timeout=TERMINATION_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                os.killpg(pod.proc.pid, signal.SIGKILL)

    # -- running a container -------------------------------------------------------------------

    def _start(self, local: LocalPod, pod: dict[str, Any]) -> None:
        container = local.container
        if "does-not-exist" in container.get("image", ""):
            self._waiting(local, "ErrImagePull", f"failed to pull image {container['image']!r}: not found")
            return
        try:
            env = {**_node_env(), **self._env(pod, container)}
        except LookupError as exc:
            self._waiting(local, "CreateContainerConfigError", str(exc.args[0]))
            return
        env["PYTHONPATH"] = os.pathsep.join([*self.extra_pythonpath, env.get("PYTHONPATH", "")]).strip(os.pathsep)
        cmd = list(container.get("command") or ["diloco-replica"]) + list(container.get("args") or [])
        if cmd[0] in ("python", "python3"):
            cmd[0] = sys.executable
        elif cmd[0] == "diloco-replica":
            cmd = [sys.executable, "-m", "diloco_replica", *cmd[1:]]
        sandbox = [*SANDBOX, str(local.hosts), pod_hostname(pod)]
        with open(local.log, "ab") as out:
            local.proc = subprocess.Popen(sandbox + cmd, env=env, cwd=self.workdir, stdout=out,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        local.waiting, local.started_at = None, _now()
        self._patch_status(local, "Running", {"running": {"startedAt": local.started_at}}, ready=True,
                           image_id=f"sha256:{secrets.token_hex(32)}", extra={"startTime": local.started_at,
                                                                              "hostIP": "127.0.0.1",
                                                                              "podIP": "127.0.0.1"})

    def _write_hosts(self, local: LocalPod, pod: dict[str, Any], dns: Sequence[Record]) -> None:
        """(Re)write the pod's hosts file in place (a bind mount follows the file, not its name);
        readers that catch it half-written fail one lookup and try again, as after a DNS miss."""
        text = hosts_file(pod, dns)
        if text != local.hosts_text:
            with os.fdopen(os.open(local.hosts, os.O_RDWR | os.O_CREAT, 0o644), "r+") as f:
                f.write(text)
                f.truncate()
            local.hosts_text = text

    def _env(self, pod: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
        meta = pod["metadata"]
        fields = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"], "metadata.uid": meta["uid"],
                  "spec.nodeName": "simulated-node",
                  "spec.serviceAccountName": pod["spec"].get("serviceAccountName") or "default",
                  **{f"status.{k}": "127.0.0.1" for k in ("hostIP", "hostIPs", "podIP", "podIPs")}}
        out: dict[str, str] = {}
        for item in container.get("env") or []:
            source = item.get("valueFrom")
            if source is None:
                out[item["name"]] = item.get("value") or ""
            elif "fieldRef" in source:
                path = source["fieldRef"]["fieldPath"]
                if path.startswith(("metadata.annotations['", "metadata.labels['")):
                    group, key = path[len("metadata."):-2].split("['", 1)
                    out[item["name"]] = (meta.get(group) or {}).get(key, "")
                else:
                    out[item["name"]] = fields[path]
            elif "secretKeyRef" in source:
                out[item["name"]] = self._secret_value(meta["namespace"], source["secretKeyRef"])
        return out

    def _secret_value(self, ns: str, ref: dict[str, Any]) -> str:
        from kubernetes.client.exceptions import ApiException

        try:
            secret = json.loads(self.core.read_namespaced_secret(ref["name"], ns, _preload_content=False).data)
        except ApiException as exc:
            if exc.status == 404:
                raise LookupError(f'secret "{ref["name"]}" not found') from None
            raise
        data = secret.get("data") or {}
        if ref["key"] not in data:
            raise LookupError(f"couldn't find key {ref['key']} in Secret {ns}/{ref['name']}")
        return base64.b64decode(data[ref["key"]]).decode()

    def _waiting(self, local: LocalPod, reason: str, message: str) -> None:
        if local.waiting != reason:
            local.waiting = reason
            self._patch_status(local, "Pending", {"waiting": {"reason": reason, "message": message}}, ready=False,
                               image_id="")

    def _report_exit(self, local: LocalPod) -> None:
        code = local.proc.returncode
        local.exit_code = code if code >= 0 else 128 - code  # a signal, as a container runtime reports it
        self._patch_status(local, "Succeeded" if local.exit_code == 0 else "Failed", {"terminated": {
            "exitCode": local.exit_code, "reason": "Completed" if local.exit_code == 0 else "Error",
            "startedAt": local.started_at, "finishedAt": _now()}}, ready=False, image_id="")

    def _patch_status(self, local: LocalPod, phase: str, state: dict[str, Any], *, ready: bool, image_id: str,
                      extra: dict[str, Any] | None = None) -> None:
        from kubernetes.client.exceptions import ApiException

        status = {"phase": phase, **(extra or {}), "containerStatuses": [{
            "name": local.container["name"], "image": local.container["image"], "imageID": image_id, "ready": ready,
            "restartCount": 0, "started": "running" in state, "state": state}]}
        try:
            self.core.patch_namespaced_pod_status(local.name, local.ns, {"status": status}, _preload_content=False)
        except ApiException as exc:
            if exc.status != 404:  # deleted since it was listed: the next sync stops it
                raise


def check_sandbox(workdir: Path) -> None:
    """Fail at once, saying why, where pods cannot get a sandbox (no `unshare`, not root)."""
    probe = workdir / "sandbox-probe.hosts"
    probe.write_text("127.0.0.1\tlocalhost\n")
    try:
        done = subprocess.run([*SANDBOX, str(probe), "sandbox-probe", "true"], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        done = subprocess.CompletedProcess([], 1, "", str(exc))
    if done.returncode != 0:
        raise RuntimeError("the simulated kubelet gives each pod its own hostname and /etc/hosts in mount and UTS "
                           "namespaces of its own (util-linux `unshare`, as root), which failed here: "
                           + (done.stderr.strip() or f"exit {done.returncode}"))


def _local(pod: dict[str, Any], workdir: Path) -> LocalPod:
    meta = pod["metadata"]
    index = (meta.get("annotations") or {}).get("batch.kubernetes.io/job-completion-index")
    job = (meta.get("labels") or {}).get("batch.kubernetes.io/job-name")
    return LocalPod(meta["namespace"], meta["name"], job, int(index) if index is not None else None,
                    pod["spec"]["containers"][0], workdir / f"{meta['namespace']}.{meta['name']}.log")


def _node_env() -> dict[str, str]:
    """What a container starts with before the pod spec's env: the image's basics, nothing of the test's."""
    return {k: os.environ[k] for k in NODE_VARS if k in os.environ}


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
