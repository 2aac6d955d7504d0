"""The Kubernetes stand-in is as strict as a 1.29 API server: what a cluster refuses, it refuses
(with the server's status and a message naming the field), what it does not implement it
answers 501 (and the test fails), and what the backend really submits it accepts."""

from __future__ import annotations

import copy
import json
import time

import pytest

from diloco.errors import BackendError
from diloco.testing import launch, plan_for
from diloco_eks import EksExecutor

NS = "checks"
JOBS, SECRETS = f"/apis/batch/v1/namespaces/{NS}/jobs", f"/api/v1/namespaces/{NS}/secrets"
SERVICES = f"/api/v1/namespaces/{NS}/services"
PATHS = {"Job": JOBS, "Secret": SECRETS, "Service": SERVICES}


def send(cluster, method, path, body=None, content_type="application/json"):
    """A request through the kubernetes client's own HTTP layer, so the body reaches the server as
    written (the newest client's generated methods check some bodies themselves before sending;
    the floor client's do not: the server's verdict is what is tested). (status, Status or object)."""
    from kubernetes.client.exceptions import ApiException

    try:
        resp = cluster.api.rest_client.request(method, cluster.url + path, body=body, headers={
            "Content-Type": content_type, "Accept": "application/json"})
    except ApiException as exc:  # the floor client raises on 4xx/5xx
        return exc.status, json.loads(exc.body)
    data = resp.read() if hasattr(resp, "read") else resp.data
    return resp.status, json.loads(data)


def backend_documents(**opts):
    """The Secret and the Job the backend plans for a two-rank launch with one secret."""
    ex = EksExecutor(image="registry.example.com/does-not-exist:1", namespace=NS, **opts)
    return plan_for(ex, 2, "train:main", run_id="checks-run", secret_env={"HF_TOKEN": "hf-value"}).body


def _job(edit):
    def make():
        job = copy.deepcopy(backend_documents()[1])
        edit(job)
        return job
    return make


def _container(job):
    return job["spec"]["template"]["spec"]["containers"][0]


def _secret(edit):
    def make():
        secret = copy.deepcopy(backend_documents()[0])
        edit(secret)
        return secret
    return make


def _service(edit):
    """The headless Service the backend plans for a replica of two nodes, edited."""
    def make():
        ex = EksExecutor(image="registry.example.com/train:1", namespace=NS)
        service = copy.deepcopy(plan_for(ex, 1, "train:main", run_id="checks-run", nodes=2).body[0])
        edit(service)
        return service
    return make


def _set(path, value):
    def edit(doc):
        *parents, last = path
        for key in parents:
            doc = doc[key]
        doc[last] = value
    return edit


TEMPLATE_SPEC = ("spec", "template", "spec")
INVALID = [
    # (id, document, HTTP status, what the message must say)
    ("unknown-field", _job(lambda j: _container(j).update(envv=[])), 400,
     'strict decoding error: unknown field "spec.template.spec.containers[0].envv"'),
    ("misspelt-spec-field", _job(_set(("spec", "backoffLimitPerIndx"), 0)), 400,
     'unknown field "spec.backoffLimitPerIndx"'),
    ("wrong-type-int", _job(_set(("spec", "completions"), "2")), 400,
     "cannot unmarshal string into Go struct field JobSpec.spec.completions of type int32"),
    ("wrong-type-env-value", _job(lambda j: _container(j)["env"][0].update(value=5)), 400,
     "cannot unmarshal number into Go struct field EnvVar.spec.template.spec.containers[0].env[0].value of type string"),
    ("missing-required", _job(lambda j: _container(j).pop("name")), 422,
     "spec.template.spec.containers[0].name: Required value"),
    ("bad-name", _job(_set(("metadata", "name"), "Bad_Name")), 422,
     'Job.batch "Bad_Name" is invalid: metadata.name: Invalid value: "Bad_Name": a lowercase RFC 1123 subdomain'),
    ("job-name-64-chars", _job(_set(("metadata", "name"), "j" * 64)), 422,
     f'spec.template.labels: Invalid value: "{"j" * 64}": must be no more than 63 characters'),
    ("bad-env-name", _job(lambda j: _container(j)["env"].append({"name": "1BAD", "value": "x"})), 422,
     ".name: Invalid value: \"1BAD\": a valid environment variable name"),
    ("label-value-64-chars", _job(lambda j: j["metadata"]["labels"].update(team="t" * 64)), 422,
     f'metadata.labels: Invalid value: "{"t" * 64}": must be no more than 63 characters'),
    ("bad-label-key", _job(lambda j: j["metadata"]["labels"].update({"bad key": "x"})), 422,
     'metadata.labels: Invalid value: "bad key": name part must consist of alphanumeric characters'),
    ("annotations-over-256KiB", _job(_set(("metadata", "annotations"), {"a": "x" * 262144})), 422,
     "metadata.annotations: Too long: must have at most 262144 bytes"),
    ("indexed-without-completions", _job(lambda j: j["spec"].pop("completions")), 422,
     "spec.completions: Required value: when completion mode is Indexed"),
    ("indexed-over-100000", _job(lambda j: j["spec"].update(completions=100001, parallelism=1)), 422,
     "spec.completions: Invalid value: 100001: must be less than or equal to 100000"),
    ("negative-parallelism", _job(_set(("spec", "parallelism"), -1)), 422,
     "spec.parallelism: Invalid value: -1: must be greater than or equal to 0"),
    ("per-index-needs-indexed", _job(_set(("spec", "completionMode"), "NonIndexed")), 422,
     "spec.backoffLimitPerIndex: Forbidden: requires indexed completion mode"),
    ("restart-always", _job(lambda j: j["spec"]["template"]["spec"].pop("restartPolicy")), 422,
     'spec.template.spec.restartPolicy: Unsupported value: "Always": supported values: "OnFailure", "Never"'),
    ("failure-policy-needs-never", _job(_set(TEMPLATE_SPEC + ("restartPolicy",), "OnFailure")), 422,
     'spec.template.spec.restartPolicy: Invalid value: "OnFailure": only "Never" is supported when podFailurePolicy'),
    ("bad-container-name", _job(lambda j: _container(j).update(name="Replica_1")), 422,
     'spec.template.spec.containers[0].name: Invalid value: "Replica_1": a lowercase RFC 1123 label'),
    ("bad-quantity", _job(lambda j: _container(j).update(resources={"requests": {"memory": "64GB"}})), 400,
     "spec.template.spec.containers[0].resources.requests[memory]: quantities must match the regular expression"),
    ("fractional-gpu", _job(lambda j: _container(j).update(resources={"limits": {"nvidia.com/gpu": "1.5"}})), 422,
     'resources.limits[nvidia.com/gpu]: Invalid value: "1.5": must be an integer'),
    ("mount-without-volume", _job(lambda j: _container(j).update(
        volumeMounts=[{"name": "dshm", "mountPath": "/dev/shm"}])), 422,
     'spec.template.spec.containers[0].volumeMounts[0].name: Not found: "dshm"'),
    ("value-and-value-from", _job(lambda j: _container(j)["env"][0].update(
        valueFrom={"fieldRef": {"fieldPath": "metadata.name"}}, value="x")), 422,
     "env[0].valueFrom: Invalid value: \"\": may not be specified when `value` is not empty"),
    ("bad-toleration", _job(_set(TEMPLATE_SPEC + ("tolerations",), [{"operator": "Equal", "value": "x"}])), 422,
     'spec.template.spec.tolerations[0].operator: Invalid value: "Equal": operator must be Exists when `key` is empty'),
    ("other-namespace", _job(_set(("metadata", "namespace"), "elsewhere")), 400,
     "the namespace of the provided object does not match the namespace sent on the request"),
    ("secret-not-base64", _secret(lambda s: s.update(data={"K": "not base64!"})), 400,
     "illegal base64 data at input byte 3"),
    ("secret-over-1MiB", _secret(lambda s: s.update(stringData={"K": "x" * (1024 * 1024 + 1)})), 422,
     "data: Too long: must have at most 1048576 bytes"),
    ("secret-bad-key", _secret(lambda s: s.update(stringData={"bad key": "x"})), 422,
     'data[bad key]: Invalid value: "bad key": a valid config key must consist of alphanumeric characters'),
    ("secret-wrong-type", _secret(lambda s: s.update(stringData={"K": 1})), 400,
     "cannot unmarshal number into Go struct field Secret.stringData[K] of type string"),
    ("service-name-not-dns1035", _service(_set(("metadata", "name"), "1-svc")), 422,
     'Service "1-svc" is invalid: metadata.name: Invalid value: "1-svc": a DNS-1035 label must consist of'),
    ("service-needs-ports-unless-headless", _service(lambda s: s["spec"].pop("clusterIP")), 422,
     "spec.ports: Required value"),
    ("service-bad-selector", _service(_set(("spec", "selector"), {"job-name": "-bad-"})), 422,
     'spec.selector: Invalid value: "-bad-"'),
    ("service-unknown-field", _service(_set(("spec", "publishNotReady"), True)), 400,
     'unknown field "spec.publishNotReady"'),
    ("service-wrong-type", _service(_set(("spec", "publishNotReadyAddresses"), "yes")), 400,
     "cannot unmarshal string into Go struct field ServiceSpec.spec.publishNotReadyAddresses of type bool"),
]


@pytest.mark.parametrize("make, status, message", [case[1:] for case in INVALID], ids=[case[0] for case in INVALID])
def test_an_invalid_document_is_refused_as_the_api_server_does(cluster, make, status, message):
    doc = make()
    code, body = send(cluster, "POST", PATHS[doc["kind"]], doc)
    assert (code, body["kind"], body["code"]) == (status, "Status", status), body
    assert body["reason"] == {400: "BadRequest", 422: "Invalid"}[status]
    assert message in body["message"], body["message"]
    if status == 422:  # the server's causes name each field
        assert all(c["field"] for c in body["details"]["causes"])
    assert not cluster.unimplemented


def test_the_real_clients_call_gets_the_same_refusal(cluster):
    """Through the client's generated method (what the backend calls), a rule the client itself
    cannot check is refused by the server as an ApiException naming the field."""
    from kubernetes.client.exceptions import ApiException

    job = copy.deepcopy(backend_documents()[1])
    job["metadata"]["name"] = "j" * 64
    with pytest.raises(ApiException) as err:
        cluster.batch.create_namespaced_job(NS, job, _preload_content=False)
    assert err.value.status == 422 and "spec.template.labels: Invalid value" in json.loads(err.value.body)["message"]


@pytest.mark.parametrize("opts", [
    {}, {"per_index": False}, {"gpu_types": {"L4": {"count": 4, "instance_type": "g6.12xlarge"}}},
    {"cpu": "8", "memory": "64Gi", "service_account": "diloco-s3", "runtime_class": "gvisor",
     "labels": {"team": "ml", "example.com/cost-center": "1234"}, "node_selector": {"pool": "gpu"},
     "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}],
     "index_retries": 2, "ttl_seconds_after_finished": 0},
])
@pytest.mark.parametrize("launch_kind", ["whole", "relaunch", "processes", "long-run-id", "nodes"])
def test_everything_the_backend_plans_is_accepted(cluster, opts, launch_kind):
    """Every document of a plan, created with the client's generated methods (as `submit` does),
    passes the stand-in's decoding and validation (dry run: nothing is started)."""
    if launch_kind == "nodes" and opts.get("index_retries"):
        opts = {k: v for k, v in opts.items() if k != "index_retries"}  # refused with several nodes
    ex = EksExecutor(image="registry.example.com/train:1", namespace=NS, **opts)
    fields = {"relaunch": {"ranks": [2], "attempt": 3}, "processes": {"processes_per_replica": 4},
              "long-run-id": {"run_id": "9" + "x" * 62},
              "nodes": {"run_id": "9" + "x" * 62, "nodes": 3, "processes_per_replica": 4}}.get(launch_kind, {})
    gpu = "L4:4" if "gpu_types" in opts else "H100:4"
    plan = plan_for(ex, 4, "train:main", {"lr": 0.1}, secret_env={"HF_TOKEN": "v"}, gpu=gpu, timeout=60.5,
                    **{"run_id": "checks-plan", **fields})
    creates = {"Job": cluster.batch.create_namespaced_job, "Secret": cluster.core.create_namespaced_secret,
               "Service": cluster.core.create_namespaced_service}
    assert ("Service" in {d["kind"] for d in plan.body}) == (launch_kind == "nodes")
    for doc in plan.body:
        stored = json.loads(creates[doc["kind"]](NS, doc, dry_run="All", _preload_content=False).data)
        assert stored["metadata"]["uid"] and stored["metadata"]["name"] == doc["metadata"]["name"]
    assert not cluster.unimplemented


def test_a_patch_is_validated_as_the_object_it_makes(cluster):
    secret = copy.deepcopy(backend_documents()[0])
    secret["metadata"]["name"] = "patched-env"
    assert send(cluster, "POST", SECRETS, secret)[0] == 201
    path = f"{SECRETS}/patched-env"
    code, body = send(cluster, "PATCH", path, {"metadata": {"ownerReference": []}},
                      "application/strategic-merge-patch+json")
    assert code == 400 and 'unknown field "metadata.ownerReference"' in body["message"]
    code, body = send(cluster, "PATCH", path, {"metadata": {"labels": {"diloco.dev/run-id": "-bad-"}}},
                      "application/strategic-merge-patch+json")
    assert code == 422 and 'metadata.labels: Invalid value: "-bad-"' in body["message"]
    owner = {"apiVersion": "batch/v1", "kind": "Job", "name": "j", "uid": "u-1", "blockOwnerDeletion": False}
    code, body = send(cluster, "PATCH", path, {"metadata": {"ownerReferences": [owner]}},
                      "application/strategic-merge-patch+json")
    assert code == 200 and body["metadata"]["ownerReferences"] == [owner]
    assert body["data"] == {"HF_TOKEN": "UkVEQUNURUQ="} and "stringData" not in body  # write-only, folded into data
    send(cluster, "DELETE", path)


def test_a_job_spec_is_immutable(cluster):
    job = copy.deepcopy(backend_documents()[1])
    job["metadata"]["name"] = "immutable"
    code, created = send(cluster, "POST", f"{JOBS}?dryRun=All", job)
    assert code == 201 and created["spec"]["selector"] == {
        "matchLabels": {"batch.kubernetes.io/controller-uid": created["metadata"]["uid"]}}
    assert send(cluster, "POST", JOBS, job)[0] == 201
    code, body = send(cluster, "PATCH", f"{JOBS}/immutable", {"spec": {"template": {"spec": {"restartPolicy": "OnFailure"}}}},
                      "application/strategic-merge-patch+json")
    assert code == 422 and "spec.template: Invalid value" in body["message"] and "field is immutable" in body["message"]
    send(cluster, "DELETE", f"{JOBS}/immutable?propagationPolicy=Background")


@pytest.mark.parametrize("method, path, body, content_type, says", [
    ("PUT", f"{SECRETS}/x", {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "x"}}, "application/json",
     "PUT on an object"),
    ("GET", f"{JOBS}?watch=true", None, "application/json", "watch"),
    ("GET", f"/api/v1/namespaces/{NS}/configmaps", None, "application/json", "the resource 'configmaps'"),
    ("GET", f"/api/v1/namespaces/{NS}/pods?fieldSelector=status.phase%3DRunning", None, "application/json",
     "the query parameter(s) fieldSelector"),
    ("PATCH", f"{SECRETS}/x", [{"op": "add", "path": "/data", "value": {}}], "application/json-patch+json",
     "the patch type application/json-patch+json"),
    ("POST", JOBS, "nonindexed", "application/json", "runs Indexed Jobs only"),
    ("POST", SERVICES, {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "vip"}, "spec": {
        "selector": {"app": "x"}, "ports": [{"port": 80}]}}, "application/json", "Services other than headless ones"),
    ("POST", SERVICES, {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "srv"}, "spec": {
        "clusterIP": "None", "selector": {"app": "x"}, "ports": [{"name": "a", "port": 80}]}}, "application/json",
     "not ports (their SRV records"),
    ("POST", f"/api/v1/namespaces/{NS}/pods", {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "aliased"},
                                              "spec": {"hostAliases": [{"ip": "10.0.0.1", "hostnames": ["a"]}],
                                                       "containers": [{"name": "c", "image": "i"}]}},
     "application/json", "does not implement pod spec.hostAliases"),
])
def test_what_the_stand_in_does_not_implement_is_answered_501(cluster, method, path, body, content_type, says):
    if body == "nonindexed":
        body = copy.deepcopy(backend_documents(per_index=False)[1])
        body["spec"]["completionMode"] = "NonIndexed"
    if method == "PATCH":
        send(cluster, "POST", SECRETS, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "x"}})
    code, status = send(cluster, method, path, body, content_type)
    try:
        assert code == 501 and status["reason"] == "NotImplemented", status
        assert status["message"].startswith(f"not implemented by the Kubernetes stand-in: {method} {path.split('?')[0]}")
        assert says in status["message"] and cluster.unimplemented == [status["message"]]
    finally:
        cluster.unimplemented.clear()  # answered 501 on purpose: this test's own requests
        send(cluster, "DELETE", f"{SECRETS}/x")


def test_a_missing_namespace_is_a_clear_error(cluster):
    ex = EksExecutor(image="img", namespace="nope", api_url=cluster.url)
    with pytest.raises(BackendError, match='namespaces "nope" not found'):
        launch(ex, 1, "train:main", run_id="no-namespace")


def test_deleting_a_job_follows_its_propagation_policy(cluster):
    """A Job's default deletion orphans its pods (they keep running); Background deletes them and
    the Secrets it owns (the garbage collector)."""
    from kubernetes.client.exceptions import ApiException

    ex = EksExecutor(image="img", namespace="lifecycle", api_url=cluster.url, command=["python", "-m", "diloco.bootstrap.runner"],
                     cache_seconds=0.05)
    handles = launch(ex, 2, "diloco.testing.entrypoints:sleep", {"seconds": 300}, run_id="orphans",
                     secret_env={"HF_TOKEN": "v"})
    job, secret = handles[0].metadata["job"], handles[0].metadata["secret"]
    assert json.loads(cluster.core.read_namespaced_secret(secret, "lifecycle", _preload_content=False).data)[
        "metadata"]["ownerReferences"][0]["name"] == job  # the backend made its Job own the Secret
    _wait(lambda: len([p for p in cluster.pods_of(job) if p.proc]) == 2)
    cluster.batch.delete_namespaced_job(job, "lifecycle", _preload_content=False)  # no policy: Orphan
    time.sleep(1)
    pods = json.loads(cluster.core.list_namespaced_pod("lifecycle", _preload_content=False).data)["items"]
    assert len(pods) == 2 and not any(p["metadata"].get("ownerReferences") for p in pods)
    assert all(p.proc.poll() is None for p in cluster.pods_of(job))  # still running: orphans burn GPUs
    cluster.core.read_namespaced_secret(secret, "lifecycle")  # orphaned too
    for pod in pods:
        cluster.core.delete_namespaced_pod(pod["metadata"]["name"], "lifecycle", _preload_content=False)
    cluster.core.delete_namespaced_secret(secret, "lifecycle", _preload_content=False)

    handles = launch(ex, 1, "diloco.testing.entrypoints:sleep", {"seconds": 300}, run_id="collected",
                     secret_env={"HF_TOKEN": "v"})
    job, secret = handles[0].metadata["job"], handles[0].metadata["secret"]
    _wait(lambda: any(p.proc for p in cluster.pods_of(job)))
    cluster.batch.delete_namespaced_job(job, "lifecycle", propagation_policy="Background", _preload_content=False)
    _wait(lambda: not cluster.pods_of(job))
    with pytest.raises(ApiException) as gone:
        cluster.core.read_namespaced_secret(secret, "lifecycle")
    assert gone.value.status == 404


def test_the_model_is_the_official_clients(cluster):
    """The 1.29 snapshot agrees with a newer installed client: same fields, same types, the newer
    one only adds (but the DRA alpha's ClaimSource, dropped in 1.31). The floor client (24.2) is
    a 1.24 model that lacks what the default Job needs: why the stand-in keeps a snapshot."""
    import re

    import kubernetes
    from kubernetes.client import models

    from diloco_eks.testing.model import ApiModel

    def normal(type_name):
        type_name = re.sub(r"List\[(.+)\]", r"list[\1]", type_name)
        type_name = re.sub(r"Dict\[str, (.+)\]", r"dict(str, \1)", type_name)
        return type_name.replace("CoreV1ResourceClaim", "V1ResourceClaim").replace("bytes", "str")

    snapshot = ApiModel.load()
    assert snapshot.client == "kubernetes==29.0.0"
    if int(kubernetes.__version__.split(".")[0]) < 29:  # the floor: a 1.24 model, older than any supported cluster
        assert "backoff_limit_per_index" not in models.V1JobSpec.openapi_types
        assert "backoffLimitPerIndex" in snapshot.models["V1JobSpec"]["fields"]
        return
    for name, spec in snapshot.models.items():
        cls = getattr(models, name, None)
        if cls is None:
            assert name in ("V1ClaimSource", "V1ResourceClaim"), name
            continue
        installed = {cls.attribute_map[a]: normal(t) for a, t in cls.openapi_types.items()}
        for field, type_name in spec["fields"].items():
            if field in installed:
                assert installed[field] == type_name, (name, field)
            else:
                assert (name, field) == ("V1PodResourceClaim", "source"), (name, field)


def _wait(condition, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_a_job_past_its_deadline_fails_and_its_pods_stop(cluster):
    """The spec's timeout becomes activeDeadlineSeconds: the Job controller fails the Job
    (DeadlineExceeded) and deletes its running pods, and the backend reports a time limit (exit 124)."""
    ex = EksExecutor(image="img", namespace="lifecycle", api_url=cluster.url, command=["python", "-m", "diloco.bootstrap.runner"],
                     cache_seconds=0.05)
    (handle,) = launch(ex, 1, "diloco.testing.entrypoints:sleep", {"seconds": 300}, run_id="deadline", timeout=1)
    (result,) = ex.collect([handle], timeout=30)
    assert result.status == "failed" and "DeadlineExceeded" in result.error, result.error
    assert result.exit_code == 124 and result.error.startswith(f"Job {handle.metadata['job']} reached its "
                                                               f"activeDeadlineSeconds")  # a time limit, not a crash
    _wait(lambda: not cluster.pods_of(handle.metadata["job"]))


def test_a_retried_index_gets_a_new_pod(cluster):
    """index_retries: Kubernetes itself recreates a failed index's pod (backoffLimitPerIndex)."""
    ex = EksExecutor(image="img", namespace="lifecycle", api_url=cluster.url, command=["python", "-m", "diloco.bootstrap.runner"],
                     cache_seconds=0.05, index_retries=1)
    (handle,) = launch(ex, 1, "diloco.testing.entrypoints:sleep", {"seconds": 2}, run_id="retried")
    job = handle.metadata["job"]
    _wait(lambda: cluster.kill_pod(job, 0))
    (result,) = ex.collect([handle], timeout=30)
    assert result.status == "succeeded", result.error
    status = json.loads(cluster.batch.read_namespaced_job(job, "lifecycle", _preload_content=False).data)["status"]
    assert (status["failed"], status["succeeded"], status["completedIndexes"]) == (1, 1, "0")


def test_the_stand_in_uses_kmocks_public_api_only():
    """kmock's `_internal` modules may change in any release; the stand-in imports what kmock exports."""
    import ast
    from pathlib import Path

    import diloco_eks

    private = []
    for source in Path(diloco_eks.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom) else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            private += [f"{source.name}: {n}" for n in names if n.startswith("kmock._")]
    assert private == []
