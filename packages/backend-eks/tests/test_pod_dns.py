"""The stand-in's cluster DNS (pure functions): which names resolve, from which pod, as Kubernetes
documents pod and Service DNS; the kubelet mounts `hosts_file` over each pod's /etc/hosts."""

from __future__ import annotations

from diloco_eks.testing.dns import hosts_file, records


def service(name, ns="ml", publish=True, **spec):
    return {"metadata": {"name": name, "namespace": ns},
            "spec": {"clusterIP": "None", "selector": {"job-name": name}, "publishNotReadyAddresses": publish, **spec}}


def pod(name, job, index, ns="ml", phase="Running", ready=True, ip="127.0.0.1", subdomain=None):
    return {"metadata": {"name": f"{job}-{index}-abcde", "namespace": ns, "labels": {"job-name": job}},
            "spec": {"hostname": f"{job}-{index}", "subdomain": subdomain or job},
            "status": {"phase": phase, "podIP": ip, "containerStatuses": [{"ready": ready}]}}


def test_a_headless_services_pods_have_their_hostname_records():
    pods = [pod("p0", "j", 0), pod("p1", "j", 1, ready=False), pod("p2", "j", 2, subdomain="other"),
            pod("p3", "j", 3, ip=None), pod("p4", "j", 4, phase="Failed")]
    assert records([service("j")], pods) == [
        ("ml", "j", "127.0.0.1"), ("ml", "j-0.j", "127.0.0.1"), ("ml", "j-1.j", "127.0.0.1")]
    # without publishNotReadyAddresses, a pod that is not ready has no record yet
    assert ("ml", "j-1.j", "127.0.0.1") not in records([service("j", publish=False)], pods)
    assert records([], pods) == [] and records([service("j", ns="other")], pods) == []
    assert records([service("j", clusterIP="10.0.0.1")], pods) == []  # a virtual IP is not served here


def test_a_pod_resolves_its_namespaces_short_names_and_others_qualified():
    dns = [("ml", "j-0.j", "127.0.0.1"), ("team", "k-0.k", "127.0.0.1")]
    text = hosts_file(pod("p1", "j", 1), dns)
    lines = [line.split("\t") for line in text.splitlines() if not line.startswith("#")]
    assert ["127.0.0.1", "j-1.j.ml.svc.cluster.local", "j-1"] in lines  # its own, as the kubelet writes it
    assert ["127.0.0.1", "j-0.j", "j-0.j.ml", "j-0.j.ml.svc", "j-0.j.ml.svc.cluster.local"] in lines
    assert ["127.0.0.1", "k-0.k.team", "k-0.k.team.svc", "k-0.k.team.svc.cluster.local"] in lines  # no short name
    assert ["127.0.0.1", "localhost"] in lines
