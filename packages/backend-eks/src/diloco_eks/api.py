"""Talking to the Kubernetes API: the client, calls with errors that name the verb and resource,
and short-lived cached reads of Jobs and pods shared by the polls of every rank.

The kubernetes client is imported on first API use, never at import or in `plan`, so
`diloco backends` and `diloco dryrun` work without the SDK configured or a cluster reachable.
Reads go through `_preload_content=False` and plain JSON, the same shapes as `kubectl get -o json`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from diloco.errors import BackendError, UserError

from .options import EksOptions
from .status import pod_index


class KubeApi:
    """One cluster, as `EksOptions` says how to reach it (api_url, kubeconfig/context, in-cluster)."""

    def __init__(self, options: EksOptions):
        self.options = options
        self._api: Any = None
        self._cache: dict[tuple[str, str, str], tuple[float, Any]] = {}

    def client(self) -> Any:
        if self._api is None:
            from kubernetes import client, config

            opts = self.options
            if opts.api_url:
                cfg = client.Configuration()
                cfg.host = opts.api_url
                self._api = client.ApiClient(cfg)
            else:
                try:
                    if opts.kubeconfig or opts.context:
                        self._api = config.new_client_from_config(config_file=opts.kubeconfig, context=opts.context)
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

    def core(self) -> Any:
        from kubernetes import client

        return client.CoreV1Api(self.client())

    def batch(self) -> Any:
        from kubernetes import client

        return client.BatchV1Api(self.client())

    def call(self, verb: str, resource: str, namespace: str, fn: Callable[..., Any], *args: Any,
             missing_ok: bool = False, **kwargs: Any) -> Any:
        """Run one API call; map API errors to messages naming the verb and resource."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return fn(*args, **kwargs)
        except ApiException as exc:
            if missing_ok and exc.status in (404, 409):
                return None
            reason = api_message(exc)
            if exc.status == 403:
                raise BackendError(f"Kubernetes forbids {verb} {resource} in namespace {namespace!r}: {reason}. "
                                   f"Grant the role (kubectl auth can-i {verb} {resource} -n {namespace})") from None
            if exc.status == 401:
                raise BackendError(f"Kubernetes rejected the credentials ({reason}); refresh your kubeconfig") from None
            raise BackendError(f"Kubernetes API error {exc.status} on {verb} {resource} in {namespace!r}: "
                               f"{reason}") from None
        except HTTPError as exc:
            host = self.client().configuration.host
            raise BackendError(f"cannot reach the Kubernetes API at {host}: {exc}") from None

    def read_json(self, verb: str, resource: str, namespace: str, fn: Callable[..., Any], *args: Any,
                  **kwargs: Any) -> Any:
        resp = self.call(verb, resource, namespace, fn, *args, _preload_content=False, missing_ok=True, **kwargs)
        return None if resp is None else json.loads(resp.data)

    def _cached(self, key: tuple[str, str, str], load: Callable[[], Any]) -> Any:
        now = time.monotonic()
        hit = self._cache.get(key)
        if hit and now - hit[0] < self.options.cache_seconds:
            return hit[1]
        value = load()
        self._cache[key] = (now, value)
        return value

    def forget_job(self, namespace: str, name: str) -> None:
        self._cache.pop(("job", namespace, name), None)

    def job(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The Job as `kubectl get -o json` shows it; None when it is gone (404)."""
        batch = self.batch()
        return self._cached(("job", namespace, name), lambda: self.read_json(
            "get", "jobs.batch", namespace, batch.read_namespaced_job, name, namespace))

    def pods(self, namespace: str, job: str) -> list[dict[str, Any]]:
        core = self.core()

        def load() -> list[dict[str, Any]]:
            data = self.read_json("list", "pods", namespace, core.list_namespaced_pod, namespace,
                                  label_selector=f"job-name={job}") or {}
            # filter here too: selectors are the server's job, but never trust a foreign pod
            return [p for p in data.get("items", [])
                    if (p.get("metadata", {}).get("labels") or {}).get("job-name") == job
                    or (p.get("metadata", {}).get("name") or "").startswith(f"{job}-")]
        return self._cached(("pods", namespace, job), load)

    def pod_for(self, namespace: str, job: str, index: int) -> dict[str, Any] | None:
        """The newest pod of `job` for completion index `index`, if any."""
        pods = [p for p in self.pods(namespace, job) if pod_index(p, job) == index]
        pods.sort(key=lambda p: p.get("metadata", {}).get("creationTimestamp") or "")
        return pods[-1] if pods else None

    def pod_log(self, namespace: str, pod: str, n_lines: int) -> str | None:
        """The pod's last `n_lines` lines; None when the pod is gone."""
        resp = self.call("get", "pods/log", namespace, self.core().read_namespaced_pod_log, pod, namespace,
                         tail_lines=n_lines, _preload_content=False, missing_ok=True)
        return None if resp is None else resp.data.decode("utf-8", "replace")


def api_message(exc: Any) -> str:
    try:
        body = json.loads(exc.body or "{}")
        return body.get("message") or exc.reason or str(exc.status)
    except (ValueError, TypeError):
        return exc.reason or str(exc.status)
