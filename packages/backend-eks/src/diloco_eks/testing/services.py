"""Services as the API server (1.29) takes them: defaulting, validation, and what the stand-in
serves of them.

The stand-in serves one kind of Service, the one pods find each other through: a *headless*
Service (`clusterIP: None`) with a selector, whose only effect is in the cluster's DNS (`dns`):
a record for each pod it selects, and one `<hostname>.<service>` per selected pod whose
`subdomain` names it. Everything else a Service can be (a virtual IP that a proxy balances,
node ports, load balancers, external names, ports with their SRV records, session affinity)
has no implementation behind it here, so such a Service is answered 501 (`unsupported`) rather
than stored and silently never served.

Defaults and rules are those of k8s.io/kubernetes pkg/apis/core (SetDefaults_Service, the
registry's IP-family defaults for a headless Service, ValidateService), reduced to the fields a
Service can carry, worded as the server's `field.Error`s.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import Any

from .model import FieldError
from .names import dns1035_label, labels
from .rules import object_meta

TYPES = ["ClusterIP", "ExternalName", "LoadBalancer", "NodePort"]
SESSION_AFFINITIES = ["ClientIP", "None"]
IP_FAMILY_POLICIES = ["PreferDualStack", "RequireDualStack", "SingleStack"]
TRAFFIC_POLICIES = ["Cluster", "Local"]


def defaults(obj: dict[str, Any]) -> None:
    """SetDefaults_Service, then what the registry sets on create for a headless Service."""
    spec = obj.setdefault("spec", {})
    spec.setdefault("type", "ClusterIP")
    spec.setdefault("sessionAffinity", "None")
    for port in spec.get("ports") or []:
        port.setdefault("protocol", "TCP")
        port.setdefault("targetPort", port.get("port"))
    if spec["type"] in ("ClusterIP", "NodePort", "LoadBalancer"):
        spec.setdefault("internalTrafficPolicy", "Cluster")
    if spec.get("clusterIP") == "None":
        spec.setdefault("clusterIPs", ["None"])
        spec.setdefault("ipFamilyPolicy", "SingleStack")
        spec.setdefault("ipFamilies", ["IPv4"])  # the cluster's primary family
    obj["status"] = {"loadBalancer": {}}


def validate(obj: Mapping[str, Any]) -> list[FieldError]:
    """ValidateService after defaulting."""
    spec = obj.get("spec") or {}
    errs = object_meta(obj.get("metadata") or {}, name_rule=dns1035_label)
    headless = spec.get("clusterIP") == "None"
    if not spec.get("ports") and not headless and spec.get("type") != "ExternalName":
        errs.append(FieldError.required("spec.ports"))
    errs += labels(spec.get("selector"), "spec.selector")
    affinity = spec.get("sessionAffinity")
    if affinity not in SESSION_AFFINITIES:
        errs.append(FieldError.unsupported("spec.sessionAffinity", affinity, SESSION_AFFINITIES))
    elif affinity == "None" and spec.get("sessionAffinityConfig") is not None:
        errs.append(FieldError.forbidden("spec.sessionAffinityConfig", "must not be set when session affinity is None"))
    ip = spec.get("clusterIP")
    if ip not in (None, "", "None") and not _is_ip(ip):
        errs.append(FieldError.invalid("spec.clusterIP", ip, "must be empty, 'None' or a valid IP address"))
    ips = spec.get("clusterIPs") or []
    if ips and ip and ips[0] != ip:
        errs.append(FieldError.invalid("spec.clusterIPs", ips, "first value must match `clusterIP`"))
    if "None" in ips and len(ips) > 1:
        errs.append(FieldError.invalid("spec.clusterIPs", ips, "'None' must be the first and only value"))
    if spec.get("type") not in TYPES:
        errs.append(FieldError.unsupported("spec.type", spec.get("type"), TYPES))
    for key, allowed in (("ipFamilyPolicy", IP_FAMILY_POLICIES), ("internalTrafficPolicy", TRAFFIC_POLICIES)):
        if spec.get(key) is not None and spec[key] not in allowed:
            errs.append(FieldError.unsupported(f"spec.{key}", spec[key], allowed))
    return errs


def unsupported(obj: Mapping[str, Any]) -> str | None:
    """What of this Service the stand-in would not serve as a cluster does (answered 501)."""
    spec = obj["spec"]
    if spec.get("type") != "ClusterIP" or spec.get("clusterIP") != "None":
        return ("Services other than headless ones (clusterIP: None): no proxy, node ports, load balancers or "
                "external names behind them here")
    if not spec.get("selector"):
        return "a headless Service without a selector (its Endpoints are written by hand; Endpoints are not served)"
    for key, why in (("ports", "ports (their SRV records and Endpoints' ports)"),
                     ("externalIPs", "externalIPs"), ("sessionAffinityConfig", "sessionAffinityConfig")):
        if spec.get(key):
            return f"Service spec.{key}: the stand-in's DNS serves A records of pods only, not {why}"
    if spec.get("sessionAffinity") != "None":
        return "Service sessionAffinity other than None (no proxy here to keep it)"
    return None


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False
