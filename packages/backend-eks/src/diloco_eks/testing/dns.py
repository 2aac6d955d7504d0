"""The cluster's DNS for pods, as Kubernetes documents it ("DNS for Services and Pods"), served
to the simulated pods as hosts files (the stand-in's own mechanism: there is no DNS server).

Records (cluster domain `cluster.local`), from the headless Services (`services`) and pods:
- a headless Service `<svc>` in namespace `<ns>` has an A record `<svc>.<ns>.svc.cluster.local`
  for each pod it selects that has an IP and is ready (or any such pod, with
  `publishNotReadyAddresses`), and has ended neither way;
- such a pod whose `hostname` is set and whose `subdomain` is `<svc>` also has
  `<hostname>.<svc>.<ns>.svc.cluster.local`. (An Indexed Job's pods get `<job>-<index>` as
  their hostname from the Job controller.)

A pod resolves names through its namespace's search path (`<ns>.svc.cluster.local`,
`svc.cluster.local`, `cluster.local`), so from a pod in `<ns>` a record of its own namespace
answers to `<name>`, `<name>.<ns>`, `<name>.<ns>.svc` and the full name, and one of another
namespace to all but the first. `hosts_file` writes exactly those names, after what a kubelet
writes in every pod's /etc/hosts (localhost and the pod's own hostname); the kubelet mounts the
file over the pod process's /etc/hosts (`kubelet`), where the C library's resolver reads it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

CLUSTER_DOMAIN = "cluster.local"
Record = tuple[str, str, str]  # (namespace, name relative to <ns>.svc.<domain>, IP)


def records(services: Iterable[dict[str, Any]], pods: Iterable[dict[str, Any]]) -> list[Record]:
    """The A records the cluster's DNS serves now, in a stable order."""
    pods = list(pods)
    out: set[Record] = set()
    for svc in services:
        meta, spec = svc["metadata"], svc.get("spec") or {}
        if spec.get("clusterIP") != "None" or not spec.get("selector"):
            continue  # the stand-in serves headless Services with a selector only (`services.unsupported`)
        for pod in pods:
            if pod["metadata"]["namespace"] != meta["namespace"] or not _selects(spec["selector"], pod):
                continue
            ip = (pod.get("status") or {}).get("podIP")
            if not ip or not (_ready(pod) or spec.get("publishNotReadyAddresses")) or _ended(pod):
                continue
            out.add((meta["namespace"], meta["name"], ip))
            hostname = pod["spec"].get("hostname")
            if hostname and pod["spec"].get("subdomain") == meta["name"]:
                out.add((meta["namespace"], f"{hostname}.{meta['name']}", ip))
    return sorted(out)


def hosts_file(pod: dict[str, Any], dns: Iterable[Record]) -> str:
    """The pod's /etc/hosts: the kubelet's part, then the names the cluster's DNS answers for it."""
    meta, spec = pod["metadata"], pod["spec"]
    ip = (pod.get("status") or {}).get("podIP") or "127.0.0.1"
    hostname = pod_hostname(pod)
    own = (f"{hostname}.{spec['subdomain']}.{meta['namespace']}.svc.{CLUSTER_DOMAIN}\t{hostname}"
           if spec.get("subdomain") else hostname)
    lines = ["# Kubernetes-managed hosts file (the stand-in's kubelet), then the stand-in's cluster DNS.",
             "127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback", f"{ip}\t{own}"]
    for namespace, name, address in dns:
        full = f"{name}.{namespace}"
        names = [name] if namespace == meta["namespace"] else []
        lines.append("\t".join([address, *names, full, f"{full}.svc", f"{full}.svc.{CLUSTER_DOMAIN}"]))
    return "\n".join(lines) + "\n"


def pod_hostname(pod: dict[str, Any]) -> str:
    """The pod's hostname, as the kubelet sets it: `spec.hostname`, else the pod's name (≤ 63)."""
    return pod["spec"].get("hostname") or pod["metadata"]["name"][:63].rstrip("-.")


def _selects(selector: dict[str, str], pod: dict[str, Any]) -> bool:
    pod_labels = pod["metadata"].get("labels") or {}
    return all(pod_labels.get(k) == v for k, v in selector.items())


def _ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    containers = status.get("containerStatuses") or []
    return status.get("phase") == "Running" and bool(containers) and all(c.get("ready") for c in containers)


def _ended(pod: dict[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")
