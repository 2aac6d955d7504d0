"""The Job manifest, field by field, and dry-run output (no cluster needed)."""

from __future__ import annotations

import json

import pytest
import yaml

from diloco.errors import SpecError, UserError
from diloco.plugins.discovery import make_executor
from diloco.procgroup import replica_command
from diloco.testing import plan_for
from diloco_eks import EksExecutor, EksOptions
from diloco_eks.gpus import resolve_gpu
from diloco_eks.k8s_values import dns_label
from diloco_eks.manifest import job_name

FIELD = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def plan(n=4, ranks=None, attempt=0, gpu=None, args=None, env=None, secret_env=None, entrypoint="train:main",
         processes_per_replica=1, nodes=1, **opts):
    ex = EksExecutor(image=opts.pop("image", "example.com/img:1"), **opts)
    return plan_for(ex, n, entrypoint, args if args is not None else {"lr": 0.5, "name": "x", "nested": {"a": 1}},
                    run_id="tiny-lm-20260101-000000-ab12", rendezvous="s3://bucket/runs", gpu=gpu, timeout=7200,
                    ranks=ranks, attempt=attempt, env=env, secret_env=secret_env,
                    processes_per_replica=processes_per_replica, nodes=nodes).body


def env_of(job):
    return {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_one_indexed_job_for_the_whole_cohort():
    (job,) = plan()
    spec = job["spec"]
    assert job["apiVersion"] == "batch/v1" and job["kind"] == "Job"
    assert spec["completions"] == spec["parallelism"] == 4 and spec["completionMode"] == "Indexed"
    assert job["metadata"]["name"] == "tiny-lm-20260101-000000-ab12-a0"
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    assert spec["ttlSecondsAfterFinished"] == 3600 and spec["activeDeadlineSeconds"] == 7200
    env = env_of(job)
    assert env["REPLICA_RANK"] == {"name": "REPLICA_RANK", "valueFrom": {"fieldRef": {"fieldPath": FIELD}}}
    assert env["DILOCO_REPLICAS"]["value"] == "4" and env["DILOCO_RENDEZVOUS"]["value"] == "s3://bucket/runs"
    assert "WORLD_SIZE" not in env  # torch's: accelerate and Lightning would wait for a group that never forms
    assert env["LR"]["value"] == "0.5" and env["NAME"]["value"] == "x" and "NESTED" not in env
    assert env["DILOCO_ENTRYPOINT"]["value"] == "train:main"
    container = pod["containers"][0]
    assert container["image"] == "example.com/img:1" and container["command"] == ["diloco-replica"]


def test_per_index_failures_and_disruptions():
    (job,) = plan()
    spec = job["spec"]
    assert spec["backoffLimitPerIndex"] == 0 and "backoffLimit" not in spec
    assert spec["podFailurePolicy"]["rules"][0] == {
        "action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    (classic,) = plan(per_index=False)
    assert classic["spec"]["backoffLimit"] == 0 and "backoffLimitPerIndex" not in classic["spec"]
    assert EksExecutor(image="i", per_index=False).capabilities.relaunches_one_rank is False
    assert EksExecutor(image="i").capabilities.relaunches_one_rank is True
    assert EksExecutor(EksOptions(image="i", per_index=False)).capabilities.relaunches_one_rank is False


def test_relaunch_of_one_rank_is_its_own_job_with_a_literal_rank():
    (job,) = plan(ranks=[2], attempt=1, args={"rank_env": "MY_RANK"})
    assert job["metadata"]["name"] == "tiny-lm-20260101-000000-ab12-r2-a1"
    assert job["spec"]["completions"] == 1 and job["metadata"]["labels"]["diloco.dev/rank"] == "2"
    env = env_of(job)
    assert env["REPLICA_RANK"]["value"] == "2" and env["MY_RANK"]["value"] == "2"
    assert env["DILOCO_ATTEMPT"]["value"] == "1"


def test_rank_env_renames_via_downward_api():
    (job,) = plan(args={"rank_env": "MY_RANK"})
    assert env_of(job)["MY_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == FIELD


def test_gpu_maps_to_count_selector_and_toleration():
    (job,) = plan(gpu="H100:8")
    pod = job["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5.48xlarge"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    for name, count, itype in [("A100:8", "8", "p4d.24xlarge"), ("A10G", "1", "g5.xlarge"), ("T4", "1", "g4dn.xlarge"),
                               ("h100:2", "2", "p5.48xlarge")]:
        (j,) = plan(gpu=name)
        p = j["spec"]["template"]["spec"]
        assert p["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == count
        assert p["nodeSelector"]["node.kubernetes.io/instance-type"] == itype


@pytest.mark.parametrize("gpu, fields, says", [
    # a bare name whose filled-in count would leave GPUs idle (gpu = "H100" once started 1 process on 8 GPUs)
    ("H100", {}, 'gpu = "H100" asks for all 8 GPUs of a p5.48xlarge but starts 1 process per pod (7 GPUs idle); '
                 'write gpu = "H100:8" (one process per GPU) or gpu = "H100:1"'),
    ("A100", {"processes_per_replica": 4, "nodes": 2},
     'starts 4 processes per node (4 GPUs idle); write gpu = "A100:8"'),
    # a GPU count no node type has: the pod would stay Pending forever
    ("H100:16", {}, "gpu 'H100:16': a pod runs on one node, and H100 nodes (p5.48xlarge) have 8 GPUs; ask for at "
                    'most gpu = "H100:8" per pod with more nodes (nodes = 2)'),
    ("a10g:2", {}, "gpu 'a10g:2': a pod runs on one node, and A10G nodes (g5.xlarge) have 1 GPU;"),
    # more processes on a node than its GPUs
    ("H100:4", {"processes_per_replica": 8, "nodes": 2}, 'processes_per_replica = 8 needs a GPU per process, but '
                                                          "gpu 'H100:4' gives each pod 4; ask for gpu = \"H100:8\""),
])
def test_a_layout_no_node_runs_is_refused_in_one_line(gpu, fields, says):
    with pytest.raises(UserError) as err:
        plan_for(EksExecutor(image="example.com/img:1"), 2, "train:main", {}, run_id="r-1", rendezvous="s3://b/runs",
                 gpu=gpu, **fields)
    assert says in str(err.value) and len(str(err.value).splitlines()) == 1, str(err.value)


def test_a_bigger_node_type_or_a_node_selector_of_your_own_lifts_the_node_bound():
    bigger = {"A10G": {"count": 4, "instance_type": "g5.12xlarge"}}
    (job,) = plan(gpu="A10G:2", gpu_types=bigger)
    assert job["spec"]["template"]["spec"]["nodeSelector"]["node.kubernetes.io/instance-type"] == "g5.12xlarge"
    (mine,) = plan(gpu="A10G:4", node_selector={"node.kubernetes.io/instance-type": "g5.12xlarge"})
    assert mine["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
    (one,) = plan(gpu="H100", processes_per_replica=8)  # a bare name is fine where every GPU gets a process
    assert one["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"


def test_user_selectors_and_tolerations_win():
    mine = [{"key": "team", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}]
    (job,) = plan(gpu="H100:8", node_selector={"node.kubernetes.io/instance-type": "p5e.48xlarge", "zone": "a"},
                  tolerations=mine)
    pod = job["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5e.48xlarge", "zone": "a"}
    assert pod["tolerations"] == mine


def test_gpu_table_is_extensible_and_unknown_gpus_are_clear():
    (job,) = plan(gpu="L4", gpu_types={"L4": {"count": 1, "instance_type": "g6.xlarge"}})
    assert job["spec"]["template"]["spec"]["nodeSelector"]["node.kubernetes.io/instance-type"] == "g6.xlarge"
    with pytest.raises(UserError, match="not a known GPU type"):
        resolve_gpu("MI300X")
    with pytest.raises(UserError, match="from 1 to 64"):
        resolve_gpu("H100:100000")


def test_pod_options():
    (job,) = plan(service_account="diloco-s3", runtime_class="gvisor", cpu="4", memory="16Gi",
                  namespace="ml", ttl_seconds_after_finished=60, labels={"team": "research"})
    pod = job["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "diloco-s3" and pod["runtimeClassName"] == "gvisor"
    assert pod["containers"][0]["resources"] == {"requests": {"cpu": "4", "memory": "16Gi"}}
    assert job["metadata"]["namespace"] == "ml" and job["spec"]["ttlSecondsAfterFinished"] == 60
    assert job["metadata"]["labels"]["team"] == "research"
    assert "tolerations" not in pod and "nodeSelector" not in pod  # no GPU asked for


def test_command_entrypoint_becomes_the_container_command():
    (job,) = plan(entrypoint=["python", "train.py", "--fast"])
    assert job["spec"]["template"]["spec"]["containers"][0]["command"] == ["python", "train.py", "--fast"]


def test_secrets_live_in_a_secret_never_in_the_job():
    docs = plan(env={"AWS_SECRET_ACCESS_KEY": "inline-secret"}, secret_env={"HF_TOKEN": "hf-secret"})
    secret, job = docs
    assert secret["kind"] == "Secret" and secret["stringData"] == {"AWS_SECRET_ACCESS_KEY": "REDACTED",
                                                                    "HF_TOKEN": "REDACTED"}
    text = json.dumps(docs)
    assert "inline-secret" not in text and "hf-secret" not in text
    env = env_of(job)
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": secret["metadata"]["name"], "key": "HF_TOKEN"}


def test_dryrun_yaml_is_what_kubectl_apply_takes(cli_yaml):
    docs = list(yaml.safe_load_all(cli_yaml))
    assert [d["kind"] for d in docs] == ["Secret", "Job"]
    for d in docs:
        assert d["apiVersion"] and d["metadata"]["name"] and d["metadata"]["namespace"] == "ml"
    assert "hf-secret-value" not in cli_yaml


@pytest.fixture
def cli_yaml(tmp_path, monkeypatch):
    import subprocess
    import sys

    (tmp_path / "diloco.toml").write_text(
        'replicas = 2\nentrypoint = "train:main"\nsecrets = ["HF_TOKEN"]\ngpu = "A10G"\n'
        'rendezvous = "s3://bucket/runs"\n'
        '[backend]\nname = "eks"\nimage = "example.com/img:1"\nnamespace = "ml"\n')
    proc = subprocess.run([sys.executable, "-m", "diloco", "dryrun", str(tmp_path / "diloco.toml")], text=True,
                          capture_output=True, env={**__import__("os").environ, "HF_TOKEN": "hf-secret-value",
                                                    "DILOCO_STATE_DIR": str(tmp_path / "state")})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("run_id", ["Tiny_LM run", "123-starts-with-digit", "x" * 200, "UPPER.case/with:chars"])
def test_job_names_are_valid_dns_labels(run_id):
    import re

    for name in (job_name(run_id, 0), job_name(run_id, 12, rank=511)):
        assert re.match(r"^[a-z]([-a-z0-9]*[a-z0-9])?$", name) and len(name) <= 52
    assert job_name("x" * 200, 0) != job_name("x" * 199 + "y", 0)  # long ids keep a hash
    assert dns_label("ok-name", 63) == "ok-name"


def test_job_names_of_runs_launched_in_the_same_second_differ():
    """New run ids are 63 characters with 64 random bits at the end, the part a Job name cuts:
    the cut is replaced by 64 bits of a hash, so two runs of one spec never share Jobs (24 bits
    gave a dozen collisions in 20,000 ids)."""
    from diloco.runrecord.state import new_run_id

    ids = {new_run_id("a-long-model-name-for-a-big-sweep-run") for _ in range(20_000)}
    names = {job_name(run_id, 3, rank=511) for run_id in ids}
    assert len(ids) == len(names) == 20_000 and all(len(n) <= 52 for n in names)


def test_missing_image_is_a_clear_error():
    with pytest.raises(UserError, match="needs \\[backend\\] image"):
        plan_for(EksExecutor(), 2, "train:main")


def test_a_replica_of_several_processes_runs_torchrun_on_its_gpus():
    ex = EksExecutor(image="example.com/img:1")
    (job,) = plan_for(ex, 2, "train:main", {}, run_id="r-1", rendezvous="s3://b/runs", gpu="H100:8",
                      processes_per_replica=8).body
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["command"][:3] == ["python", "-m", "diloco_replica.torchrun"]
    assert container["command"][container["command"].index("--nproc-per-node") + 1] == "8"
    assert container["command"][container["command"].index("--max-restarts") + 1] == "0"  # the supervisor restarts
    assert container["command"][-2:] == ["-m", "diloco.bootstrap.runner"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    assert container["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}]
    assert pod["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    env = env_of(job)
    assert env["DILOCO_REPLICAS"]["value"] == "2" and "WORLD_SIZE" not in env  # torchrun sets torch's own
    (single,) = plan_for(ex, 2, "train:main", {}, run_id="r-1", rendezvous="s3://b/runs", gpu="H100:8").body
    assert env_of(single)["DILOCO_REPLICAS"]["value"] == "2" and "volumes" not in single["spec"]["template"]["spec"]


def test_more_processes_than_gpus_or_a_custom_command_is_a_clear_error():
    ex = EksExecutor(image="example.com/img:1")
    with pytest.raises(UserError, match='needs a GPU per process.*gpu = "A10G:4"'):
        plan_for(ex, 2, "train:main", {}, run_id="r-1", rendezvous="s3://b/runs", gpu="A10G:2",
                 processes_per_replica=4)
    with pytest.raises(UserError, match="command replaces the replica's launcher"):
        plan_for(EksExecutor(image="x:1", command=["my-launcher"]), 2, "train:main", {}, run_id="r-1",
                 rendezvous="s3://b/runs", processes_per_replica=2)


def test_a_replica_of_several_nodes_is_an_indexed_job_of_its_own_with_a_headless_service():
    """nodes = 2: per replica a Service and a Job of 2 pods; node rank = completion index, node 0
    found by its stable DNS name, one pod lost fails the whole Job (and only that replica's)."""
    docs = plan(n=2, gpu="H100:8", processes_per_replica=8, nodes=2, secret_env={"HF_TOKEN": "hf-secret"})
    assert [d["kind"] for d in docs] == ["Secret", "Service", "Job"] * 2
    for rank, (secret, service, job) in enumerate(zip(docs[::3], docs[1::3], docs[2::3])):
        name = f"tiny-lm-20260101-000000-ab12-r{rank}-a0"
        assert job["metadata"]["name"] == service["metadata"]["name"] == name
        assert secret["metadata"]["name"] == f"{name}-env"
        assert service["spec"] == {"clusterIP": "None", "selector": {"batch.kubernetes.io/job-name": name},
                                   "publishNotReadyAddresses": True}
        spec, pod = job["spec"], job["spec"]["template"]["spec"]
        assert (spec["completions"], spec["parallelism"], spec["completionMode"]) == (2, 2, "Indexed")
        assert spec["backoffLimit"] == 0 and "backoffLimitPerIndex" not in spec and "podFailurePolicy" not in spec
        assert pod["subdomain"] == name and pod["restartPolicy"] == "Never"
        env = env_of(job)
        assert env["REPLICA_RANK"]["value"] == str(rank) and env["DILOCO_REPLICAS"]["value"] == "2"
        assert env["PET_NODE_RANK"] == {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": FIELD}}}
        assert env["PET_MASTER_ADDR"]["value"] == f"{name}-0.{name}" and env["PET_MASTER_PORT"]["value"] == "29400"
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == f"{name}-env"
        command = pod["containers"][0]["command"]
        assert command == replica_command(8, 2)
        assert pod["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "8"}  # per node
        assert job["metadata"]["labels"] == service["metadata"]["labels"]
        assert job["metadata"]["labels"]["diloco.dev/rank"] == str(rank)
    (relaunch,) = [d for d in plan(n=2, nodes=2, ranks=[1], attempt=3) if d["kind"] == "Job"]
    assert relaunch["metadata"]["name"].endswith("-r1-a3") and relaunch["spec"]["completions"] == 2
    name = relaunch["metadata"]["name"]
    assert env_of(relaunch)["PET_MASTER_ADDR"]["value"] == f"{name}-0.{name}"
    single = plan(n=2)  # one node per replica: one Job for the world, as before, no Service
    assert [d["kind"] for d in single] == ["Job"] and "subdomain" not in single[0]["spec"]["template"]["spec"]


def test_a_replica_of_several_nodes_refuses_what_cannot_rejoin_it():
    for opts, says in [({"index_retries": 1}, "index_retries = 1 retries one pod in place, which cannot rejoin"),
                       ({"command": ["my-launcher"]}, "[backend] command replaces the replica's launcher, which starts "
                                                      "each of the 2 nodes")]:
        with pytest.raises(UserError) as err:
            plan(n=2, nodes=2, **opts)
        assert says in str(err.value) and len(str(err.value).splitlines()) == 1, str(err.value)
    assert EksExecutor(image="i").capabilities.multi_node is True


def test_the_dry_run_of_several_nodes_shows_the_service_and_the_jobs(tmp_path):
    import os
    import subprocess
    import sys

    (tmp_path / "diloco.toml").write_text(
        'replicas = 2\nnodes = 2\nentrypoint = "train:main"\ngpu = "H100:8"\nrendezvous = "s3://bucket/runs"\n'
        '[backend]\nname = "eks"\nimage = "example.com/img:1"\nnamespace = "ml"\n')
    proc = subprocess.run([sys.executable, "-m", "diloco", "dryrun", str(tmp_path / "diloco.toml")], text=True,
                          capture_output=True, env={**os.environ, "DILOCO_STATE_DIR": str(tmp_path / "state")})
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    assert [d["kind"] for d in docs] == ["Service", "Job", "Service", "Job"]
    job = docs[1]
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--nnodes") + 1] == "2" and command[command.index("--nproc-per-node") + 1] == "8"
    (tmp_path / "diloco.toml").write_text((tmp_path / "diloco.toml").read_text().replace('"H100:8"', '"H100"'))
    proc = subprocess.run([sys.executable, "-m", "diloco", "dryrun", str(tmp_path / "diloco.toml")], text=True,
                          capture_output=True, env={**os.environ, "DILOCO_STATE_DIR": str(tmp_path / "state")})
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert 'write gpu = "H100:8" (one process per GPU)' in proc.stderr


def test_relaunch_of_several_ranks_is_one_job_each_in_request_order():
    docs = plan(ranks=[3, 1], attempt=2, secret_env={"HF_TOKEN": "hf-secret"})
    assert [(d["kind"], d["metadata"]["name"]) for d in docs] == [
        ("Secret", "tiny-lm-20260101-000000-ab12-r3-a2-env"), ("Job", "tiny-lm-20260101-000000-ab12-r3-a2"),
        ("Secret", "tiny-lm-20260101-000000-ab12-r1-a2-env"), ("Job", "tiny-lm-20260101-000000-ab12-r1-a2")]
    assert env_of(docs[3])["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == docs[2]["metadata"]["name"]


def test_plan_is_the_yaml_documents_and_deterministic():
    ex = EksExecutor(image="example.com/img:1", namespace="ml")
    first = plan_for(ex, 2, "train:main", {"lr": 0.1}, run_id="r-1", secret_env={"HF_TOKEN": "hf-secret-value"})
    again = plan_for(EksExecutor(image="example.com/img:1", namespace="ml"), 2, "train:main", {"lr": 0.1},
                     run_id="r-1", secret_env={"HF_TOKEN": "hf-secret-value"})
    assert first.format == "yaml" and first.backend_name == "eks"
    assert list(yaml.safe_load_all(first.render())) == first.body == again.body
    assert "&id" not in first.render()  # plain documents, no YAML anchors
    assert "hf-secret-value" not in first.render()


def test_options_are_declared_with_the_old_defaults():
    opts = EksExecutor().options
    assert isinstance(opts, EksOptions) and opts == EksOptions()
    assert (opts.image, opts.namespace, opts.command, opts.tolerations, opts.ttl_seconds_after_finished,
            opts.per_index, opts.index_retries, opts.cache_seconds) == (None, "default", None, None, 3600, True, 0, 0.5)
    assert (opts.node_selector, opts.gpu_types, opts.labels) == ({}, {}, {})
    assert (opts.kubeconfig, opts.context, opts.api_url) == (None, None, None)
    assert EksExecutor(EksOptions(namespace="ml"), cache_seconds=2).options == EksOptions(namespace="ml",
                                                                                          cache_seconds=2.0)


@pytest.mark.parametrize("table, key", [
    ({"command": "diloco-replica"}, "backend.command"),  # a string where a list goes
    ({"node_selector": ["zone=a"]}, "backend.node_selector"),
    ({"cache_seconds": float("nan")}, "backend.cache_seconds"),
    ({"cache_seconds": float("inf")}, "backend.cache_seconds"),
    ({"cache_seconds": -1}, "backend.cache_seconds"),
    ({"index_retries": -1}, "backend.index_retries"),
    ({"index_retries": 1.5}, "backend.index_retries"),
    ({"ttl_seconds_after_finished": -5}, "backend.ttl_seconds_after_finished"),
    ({"per_index": "yes"}, "backend.per_index"),
    ({"namespace": "Not_A_Name"}, "backend.namespace"),
    # values that go into the Job verbatim, which the API server would refuse at submit (422)
    ({"labels": {"team": "ML Platform"}}, "backend.labels"),
    ({"labels": {"bad name!": "x"}}, "backend.labels"),
    ({"labels": {"team": "t" * 64}}, "backend.labels"),
    ({"node_selector": {"pool": "gpu pool"}}, "backend.node_selector"),
    ({"gpu_types": {"L4": {"count": 1, "instance_type": "g6 xlarge"}}}, "backend.gpu_types"),
    # gpu_types entries: the count becomes the pod's GPU limit as written
    ({"gpu_types": {"L4": {"count": [1], "instance_type": "g6.xlarge"}}}, "backend.gpu_types.L4.count"),
    ({"gpu_types": {"L4": {"count": 1.5, "instance_type": "g6.xlarge"}}}, "backend.gpu_types.L4.count"),
    ({"gpu_types": {"L4": {"count": True, "instance_type": "g6.xlarge"}}}, "backend.gpu_types.L4.count"),
    ({"gpu_types": {"L4": {"count": 0, "instance_type": "g6.xlarge"}}}, "backend.gpu_types.L4.count"),
    ({"gpu_types": {"L4": {"count": 10**23, "instance_type": "g6.xlarge"}}}, "backend.gpu_types.L4.count"),
    ({"gpu_types": {"L4": {"count": 1, "instance_type": 6}}}, "backend.gpu_types.L4.instance_type"),
    ({"gpu_types": {"L4": {"count": 1, "instance": "g6.xlarge"}}}, "backend.gpu_types.L4.instance"),
    ({"gpu_types": {"L4:2": {"count": 1}}}, "backend.gpu_types"),
    # keys that look like secrets: options land in run.json and the dry run (a toleration's `key` is a field)
    ({"labels": {"api_token": "x"}}, "backend.labels.api_token"),
    ({"node_selector": {"password": "x"}}, "backend.node_selector.password"),
    ({"gpu_types": {"L4": {"count": 1, "secret": "x"}}}, "backend.gpu_types.L4.secret"),
    ({"memory": "64GB"}, "backend.memory"),
    ({"cpu": "two"}, "backend.cpu"),
    ({"service_account": "My_SA"}, "backend.service_account"),
    ({"runtime_class": "gVisor"}, "backend.runtime_class"),
    ({"tolerations": [{"key": "gpu", "operator": "Exists", "value": "yes"}]}, "backend.tolerations"),
    ({"tolerations": [{"key": "gpu", "effect": "NoSchedul"}]}, "backend.tolerations"),
    ({"imag": "x"}, "backend.imag"),
])
def test_bad_backend_option_is_one_line_naming_the_key(table, key):
    with pytest.raises(SpecError) as err:
        make_executor(EksExecutor, {"image": "example.com/img:1", **table}, source="diloco.toml")
    msg = str(err.value)
    assert f"`{key}`" in msg and len(msg.splitlines()) == 1 and msg.startswith("diloco.toml")


def test_bad_option_from_python_is_refused_too():
    with pytest.raises(SpecError, match="backend.index_retries"):
        EksExecutor(image="i", index_retries=-1)
    with pytest.raises(ValueError, match="backend.namespace"):
        EksExecutor(image="i", namespace="UPPER")


@pytest.mark.parametrize("text", [" 1", "1_0", "-1", "\u0661"])
def test_quantities_follow_the_servers_grammar_not_the_clients_laxer_parser(text):
    """kubernetes.utils.parse_quantity takes these; the API server refuses them (a 422 at submit),
    so the options refuse them at dry run instead. If the client's parser ever grows strict, the
    hand-written grammar can go."""
    from kubernetes.utils import parse_quantity

    from diloco_eks.k8s_values import quantity_problem

    parse_quantity(text)  # the client accepts it
    assert quantity_problem(text)
