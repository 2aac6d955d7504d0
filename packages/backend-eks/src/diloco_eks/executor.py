"""EksExecutor: replicas as pods of Kubernetes Indexed Jobs (EKS or any cluster ≥ 1.29).

The kubernetes client is imported on first API use, never at import or in `dryrun`, so
`diloco backends` and `diloco dryrun` work without the SDK configured or a cluster reachable.
Reads go through `_preload_content=False` and plain JSON, the same shapes as `kubectl get -o json`.

Per-rank relaunch (the supervisor's default policy): Jobs carry `backoffLimitPerIndex: 0`, so a
failed index is marked in `failedIndexes` while the other pods keep running; the supervisor sees
that rank `failed` and relaunches it as a one-pod Job `<run>-r<rank>-a<attempt>` with the rank as
a literal. With `per_index = false` (clusters < 1.29) Jobs use `backoffLimit: 0` and the
supervisor restarts the whole gang instead.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from diloco.errors import BackendError, UserError
from diloco.failures import cause_from_log, signal_cause
from diloco.launchenv import check_ranks, is_secret_name, parse_entrypoint, replica_env
from diloco.protocol import ENV_RANK, LaunchPlan, ReplicaHandle, ReplicaResult, ReplicaStatus
from diloco.state import new_run_id
from diloco.waiting import poll_until_terminal

from . import manifest as m
from .status import index_status, pod_index, terminated, waiting_problem


class EksExecutor:
    """One Kubernetes Indexed Job per attempt, one pod per rank (see the README for the manifest).

    Args:
        image: the container image holding diloco-replica (packages/replica/Dockerfile builds one); required.
        namespace: the namespace Jobs and Secrets are created in.
        command: the container command; default ["diloco-replica"] (a command entrypoint replaces it).
        service_account: serviceAccountName of the pods (IRSA / workload identity for the store); not created.
        runtime_class: runtimeClassName (gVisor, Kata); referenced, never created.
        node_selector: extra nodeSelector labels (yours win over the GPU's instance type).
        tolerations: pod tolerations; default with a GPU: nvidia.com/gpu Exists NoSchedule.
        cpu: CPU request per pod, e.g. "8".
        memory: memory request per pod, e.g. "64Gi".
        ttl_seconds_after_finished: seconds a finished Job stays before Kubernetes deletes it.
        per_index: one pod per index with its own backoff (backoffLimitPerIndex), so one rank can be relaunched alone;
            false: the whole Job fails fast and restarts as a gang.
        index_retries: retries Kubernetes itself gives each index before diloco relaunches it.
        gpu_types: more GPU names, e.g. { L4 = { count = 1, instance_type = "g6.xlarge" } }.
        labels: extra labels on Jobs and pods.
        kubeconfig: kubeconfig file (default: $KUBECONFIG, ~/.kube/config, or in-cluster config).
        context: kubeconfig context (default: the current one).
        api_url: a plain API server URL instead of a kubeconfig (an API proxy, or an emulator in tests).
        cache_seconds: how long one read of the cluster's Jobs and pods serves polls of every rank.
    """

    backend_name = "eks"
    supports_inter_replica_network = True
    shares_launcher_filesystem = False  # pods have their own disks: the rendezvous must be an object store

    def __init__(self, *, image: str | None = None, namespace: str = "default", command: list[str] | None = None,
                 service_account: str | None = None, runtime_class: str | None = None,
                 node_selector: dict[str, str] | None = None, tolerations: list[dict[str, Any]] | None = None,
                 cpu: str | None = None, memory: str | None = None, ttl_seconds_after_finished: int = 3600,
                 per_index: bool = True, index_retries: int = 0, gpu_types: dict[str, dict[str, Any]] | None = None,
                 labels: dict[str, str] | None = None, kubeconfig: str | None = None, context: str | None = None,
                 api_url: str | None = None, cache_seconds: float = 0.5):
        if index_retries < 0:
            raise ValueError("index_retries must be >= 0")
        if namespace != m.dns_label(namespace, 63):
            raise ValueError(f"namespace {namespace!r} is not a valid Kubernetes name")
        self.opts = m.PodOptions(
            image=image or "", namespace=namespace, command=command, service_account=service_account,
            runtime_class=runtime_class, node_selector=dict(node_selector or {}), tolerations=tolerations,
            cpu=cpu, memory=memory, ttl_seconds_after_finished=ttl_seconds_after_finished, per_index=per_index,
            index_retries=index_retries, gpu_types=dict(gpu_types or {}), labels=dict(labels or {}))
        self.supports_rank_relaunch = per_index
        self.kubeconfig, self.context, self.api_url = kubeconfig, context, api_url
        self.cache_seconds = cache_seconds
        self._api = None
        self._cache: dict[tuple[str, str, str], tuple[float, Any]] = {}
        self._errors: dict[tuple[str, int], str] = {}

    # -- the cluster ---------------------------------------------------------------------------

    def _client(self):
        if self._api is None:
            from kubernetes import client, config

            if self.api_url:
                cfg = client.Configuration()
                cfg.host = self.api_url
                self._api = client.ApiClient(cfg)
            else:
                try:
                    if self.kubeconfig or self.context:
                        self._api = config.new_client_from_config(config_file=self.kubeconfig, context=self.context)
                    else:
                        try:
                            config.load_incluster_config()
                            self._api = client.ApiClient()
                        except config.ConfigException:
                            self._api = config.new_client_from_config()
                except (config.ConfigException, FileNotFoundError, TypeError) as exc:
                    raise UserError(f"no Kubernetes credentials: not in a cluster and no usable kubeconfig ({exc}); "
                                    "set KUBECONFIG or run `aws eks update-kubeconfig --name CLUSTER`, or set "
                                    "[backend] kubeconfig / context") from None
        return self._api

    def _call(self, verb: str, resource: str, namespace: str, fn, *args, missing_ok: bool = False, **kwargs):
        """Run one API call; map API errors to messages naming the verb and resource."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return fn(*args, **kwargs)
        except ApiException as exc:
            if missing_ok and exc.status in (404, 409):
                return None
            reason = _api_message(exc)
            if exc.status == 403:
                raise BackendError(f"Kubernetes forbids {verb} {resource} in namespace {namespace!r}: {reason}. "
                                   "Grant the role (kubectl auth can-i {verb} {resource} -n {namespace})".format(
                                       verb=verb, resource=resource, namespace=namespace)) from None
            if exc.status == 401:
                raise BackendError(f"Kubernetes rejected the credentials ({reason}); refresh your kubeconfig") from None
            raise BackendError(f"Kubernetes API error {exc.status} on {verb} {resource} in {namespace!r}: "
                               f"{reason}") from None
        except HTTPError as exc:
            host = self._client().configuration.host
            raise BackendError(f"cannot reach the Kubernetes API at {host}: {exc}") from None

    def _read_json(self, verb: str, resource: str, namespace: str, fn, *args, **kwargs) -> Any:
        resp = self._call(verb, resource, namespace, fn, *args, _preload_content=False, missing_ok=True, **kwargs)
        return None if resp is None else json.loads(resp.data)

    def _cached(self, key: tuple[str, str, str], load) -> Any:
        now = time.monotonic()
        hit = self._cache.get(key)
        if hit and now - hit[0] < self.cache_seconds:
            return hit[1]
        value = load()
        self._cache[key] = (now, value)
        return value

    def _job(self, namespace: str, name: str) -> dict[str, Any] | None:
        from kubernetes import client

        batch = client.BatchV1Api(self._client())
        return self._cached(("job", namespace, name), lambda: self._read_json(
            "get", "jobs.batch", namespace, batch.read_namespaced_job, name, namespace))

    def _pods(self, namespace: str, job: str) -> list[dict[str, Any]]:
        from kubernetes import client

        core = client.CoreV1Api(self._client())

        def load() -> list[dict[str, Any]]:
            data = self._read_json("list", "pods", namespace, core.list_namespaced_pod, namespace,
                                   label_selector=f"job-name={job}") or {}
            # filter here too: selectors are the server's job, but never trust a foreign pod
            return [p for p in data.get("items", [])
                    if (p.get("metadata", {}).get("labels") or {}).get("job-name") == job
                    or (p.get("metadata", {}).get("name") or "").startswith(f"{job}-")]
        return self._cached(("pods", namespace, job), load)

    def _pod_for(self, handle: ReplicaHandle) -> dict[str, Any] | None:
        md = handle.metadata
        pods = [p for p in self._pods(md["namespace"], md["job"]) if pod_index(p, md["job"]) == md["index"]]
        pods.sort(key=lambda p: p.get("metadata", {}).get("creationTimestamp") or "")
        return pods[-1] if pods else None

    # -- launching -----------------------------------------------------------------------------

    def _plan(self, n_replicas, entrypoint, entrypoint_args, *, gpu, timeout, run_id, rendezvous, ranks, attempt,
              env, secret_env, processes=1) -> tuple[str, list[tuple[list[int], dict[str, Any], dict[str, Any] | None]]]:
        """(run id, [(ranks, Job, its env Secret or None)]) — one Secret per Job, so relaunches of
        different ranks never share (or delete) each other's."""
        if not self.opts.image:
            raise UserError("the eks backend needs [backend] image: a container image with your code and "
                            "diloco-replica installed")
        ep = parse_entrypoint(entrypoint)
        run_id = run_id or new_run_id("eks")
        chosen = check_ranks(n_replicas, ranks)
        gpu_req = m.resolve_gpu(gpu, self.opts.gpu_types)
        args = dict(entrypoint_args or {})
        rank_env = str(args.get("rank_env", ENV_RANK))
        base = replica_env(rank=0, n_replicas=n_replicas, run_id=run_id, attempt=attempt, entrypoint=ep,
                           entrypoint_args=args, rendezvous=rendezvous, timeout=timeout, env=env,
                           processes=processes)
        base.pop("PYTHONPATH", None)
        secrets = dict(secret_env or {})
        secrets.update({k: v for k, v in base.items() if is_secret_name(k)})
        literal = {k: v for k, v in base.items() if k not in secrets}
        groups = [chosen] if chosen == list(range(n_replicas)) else [[r] for r in chosen]
        jobs = []
        for group in groups:
            name = m.job_name(run_id, attempt, None if len(group) == n_replicas else group[0])
            secret_name = f"{name}-env" if secrets else None
            job = m.build_job(name=name, run_id=run_id, attempt=attempt, ranks=group, n_replicas=n_replicas,
                              entrypoint=ep, env=literal, rank_env=rank_env, secret_names=sorted(secrets),
                              secret_ref=secret_name, timeout=timeout, gpu=gpu_req, opts=self.opts,
                              processes=processes)
            secret = (m.build_secret(name=secret_name, run_id=run_id, namespace=self.opts.namespace,
                                     values=secrets) if secrets else None)
            jobs.append((group, job, secret))
        return run_id, jobs

    def dryrun(self, n_replicas, entrypoint, entrypoint_args=None, *, gpu=None, timeout=3600, run_id=None,
               rendezvous=None, ranks=None, attempt=0, env=None, secret_env=None,
               processes_per_replica=1) -> LaunchPlan:
        _, jobs = self._plan(n_replicas, entrypoint, entrypoint_args, gpu=gpu, timeout=timeout, run_id=run_id,
                             rendezvous=rendezvous, ranks=ranks, attempt=attempt, env=env, secret_env=secret_env,
                             processes=processes_per_replica)
        docs = []
        for _, job, secret in jobs:
            if secret:
                docs.append({**secret, "stringData": {k: m.REDACTED for k in secret["stringData"]}})
            docs.append(job)
        return LaunchPlan(self.backend_name, docs, format="yaml")

    def launch_replicas(self, n_replicas, entrypoint, entrypoint_args=None, *, gpu=None, timeout=3600,
                        run_id=None, rendezvous=None, ranks=None, attempt=0, env=None,
                        secret_env=None, processes_per_replica=1) -> list[ReplicaHandle]:
        from kubernetes import client

        run_id, jobs = self._plan(n_replicas, entrypoint, entrypoint_args, gpu=gpu, timeout=timeout,
                                  run_id=run_id, rendezvous=rendezvous, ranks=ranks, attempt=attempt,
                                  env=env, secret_env=secret_env, processes=processes_per_replica)
        ns = self.opts.namespace
        core, batch = client.CoreV1Api(self._client()), client.BatchV1Api(self._client())
        handles = []
        for group, job, secret in jobs:
            if secret:
                self._call("delete", "secrets", ns, core.delete_namespaced_secret, secret["metadata"]["name"], ns,
                           missing_ok=True, _preload_content=False)
                self._call("create", "secrets", ns, core.create_namespaced_secret, ns, secret, _preload_content=False)
            resp = self._call("create", "jobs.batch", ns, batch.create_namespaced_job, ns, job,
                              _preload_content=False)
            uid = (json.loads(resp.data).get("metadata") or {}).get("uid")
            if secret and uid:  # garbage-collected with its Job
                owner = {"apiVersion": "batch/v1", "kind": "Job", "name": job["metadata"]["name"], "uid": uid,
                         "blockOwnerDeletion": False}
                self._call("patch", "secrets", ns, core.patch_namespaced_secret, secret["metadata"]["name"], ns,
                           {"metadata": {"ownerReferences": [owner]}}, missing_ok=True, _preload_content=False)
            for i, rank in enumerate(group):
                handles.append(ReplicaHandle(rank, self.backend_name, {
                    "run_id": run_id, "attempt": attempt, "job": job["metadata"]["name"], "namespace": ns,
                    "index": rank if len(group) == n_replicas else i, "context": self.context,
                    "secret": secret["metadata"]["name"] if secret else None}))
        return sorted(handles, key=lambda h: h.rank)

    # -- observing -----------------------------------------------------------------------------

    def poll(self, handle: ReplicaHandle) -> ReplicaStatus:
        md = handle.metadata
        status = index_status(self._job(md["namespace"], md["job"]), md["index"])
        if status in (ReplicaStatus.RUNNING, ReplicaStatus.PENDING):
            pod = self._pod_for(handle)
            problem = waiting_problem(pod) if pod else None
            if problem:
                self._errors[(md["job"], md["index"])] = f"pod {pod['metadata']['name']} cannot start: {problem}"
                return ReplicaStatus.FAILED
            if pod is None or (pod.get("status") or {}).get("phase") == "Pending":
                return ReplicaStatus.PENDING
        return status

    def stream_logs(self, handle: ReplicaHandle, *, n_lines: int = 200) -> str:
        from kubernetes import client

        md = handle.metadata
        pod = self._pod_for(handle)
        if pod is None:
            return f"(no pod yet for rank {handle.rank} of job {md['job']})\n"
        name = pod["metadata"]["name"]
        problem = waiting_problem(pod)
        if problem:
            return f"(pod {name} cannot start: {problem})\n"
        if (pod.get("status") or {}).get("phase") == "Pending":
            return f"(pod {name} is pending: not scheduled or still starting)\n"
        core = client.CoreV1Api(self._client())
        resp = self._call("get", "pods/log", md["namespace"], core.read_namespaced_pod_log, name, md["namespace"],
                          tail_lines=n_lines, _preload_content=False, missing_ok=True)
        if resp is None:
            return f"(pod {name} is gone; its logs went with it)\n"
        return resp.data.decode("utf-8", "replace")

    def collect(self, handles: Sequence[ReplicaHandle], *, timeout: float | None = None) -> list[ReplicaResult]:
        statuses = poll_until_terminal(self, handles, timeout=timeout, interval=max(self.cache_seconds, 0.2))
        return [self._result(h, s) for h, s in zip(handles, statuses)]

    def _result(self, handle: ReplicaHandle, status: ReplicaStatus) -> ReplicaResult:
        md = handle.metadata
        if status is ReplicaStatus.CANCELLED:
            return ReplicaResult(handle.rank, status, None, "cancelled (the Job was deleted)", None, handle.attempt)
        if not status.is_terminal:
            return ReplicaResult(handle.rank, status, None, None, None, handle.attempt)
        pod = self._pod_for(handle)
        term = terminated(pod) if pod else None
        code = term.get("exitCode") if term else None
        if status is ReplicaStatus.SUCCEEDED:  # the entrypoint's return value travels in the pod's log, as JSON
            from diloco.runner import result_from_log

            result = result_from_log(self.stream_logs(handle, n_lines=20)) if pod else None
            return ReplicaResult(handle.rank, status, code if code is not None else 0, None, result, handle.attempt)
        error = self._errors.get((md["job"], md["index"]))
        if error is None:
            job = self._job(md["namespace"], md["job"]) or {}
            reasons = [f"{c.get('reason')}: {c.get('message')}" for c in (job.get("status") or {}).get("conditions") or []
                       if c.get("type") == "Failed" and c.get("status") == "True"]
            parts = [_exit_cause(code, (term or {}).get("reason"))]
            if term and term.get("message"):
                parts.append(term["message"])
            parts += reasons
            tail = self.stream_logs(handle, n_lines=20).strip() if pod else ""
            error = "; ".join(parts) + (f"\n{tail}" if tail else "")
            cause = cause_from_log(tail)
            if cause:  # the replica said why it stopped: that is the cause, the pod's exit comes after
                error = f"{cause}\n{error}"
        return ReplicaResult(handle.rank, status, code if code is not None else 1, error, None, handle.attempt)

    # -- stopping ------------------------------------------------------------------------------

    def cancel(self, handle: ReplicaHandle) -> None:
        """Delete the handle's Job (the whole cohort it launched) and its env Secret.

        Background propagation: the default orphans pods that would keep burning GPUs. Already
        gone (404) or being deleted (409) is fine; any other API error is raised.
        """
        from kubernetes import client

        md = handle.metadata
        ns = md["namespace"]
        batch, core = client.BatchV1Api(self._client()), client.CoreV1Api(self._client())
        if index_status(self._job(ns, md["job"]), md["index"]) in (ReplicaStatus.SUCCEEDED, ReplicaStatus.FAILED):
            return  # ended on its own: keep its status (the Job's TTL cleans it up)
        self._call("delete", "jobs.batch", ns, batch.delete_namespaced_job, md["job"], ns,
                   propagation_policy="Background", missing_ok=True, _preload_content=False)
        if md.get("secret"):
            self._call("delete", "secrets", ns, core.delete_namespaced_secret, md["secret"], ns, missing_ok=True,
                       _preload_content=False)
        self._cache.pop(("job", ns, md["job"]), None)


def _exit_cause(code: int | None, reason: str | None) -> str:
    """The cause first (the rule in `diloco.failures`): OOM kill, signal, or exit code."""
    if reason == "OOMKilled":
        return f"OOM-killed (exit code {code})"
    killed = signal_cause(code)
    if killed:
        return killed
    return f"pod exited with code {code}" if code is not None else f"pod failed{f' ({reason})' if reason else ''}"


def _api_message(exc: Any) -> str:
    try:
        body = json.loads(exc.body or "{}")
        return body.get("message") or exc.reason or str(exc.status)
    except (ValueError, TypeError):
        return exc.reason or str(exc.status)

