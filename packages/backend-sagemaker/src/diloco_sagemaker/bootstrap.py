"""The first thing a diloco training job runs (its ContainerEntrypoint); uploaded beside the code.

SageMaker downloads the job's `diloco` input channel to /opt/ml/input/data/diloco/ before the
container starts: this file, `secretsreader.py`, and what the run ships — `source.tar.gz` (the
spec's workdir), `env-<hash>.json` (environment values longer than SageMaker's 512 characters),
`wheels/` (diloco and what the image lacks, on an official PyTorch image). It then:

1. adds the values of `DILOCO_ENV_FILE` to the environment (long entrypoint args, settings);
2. unpacks the workdir into /opt/ml/code (data-only extraction: no absolute paths, links out
   of the tree or device files) and puts it first on PYTHONPATH;
3. installs `DILOCO_WHEELS` from the shipped wheels with `pip --no-index` (no package index,
   no internet needed), then `DILOCO_PIP_INSTALL` (`[backend] pip`, from the index);
4. resolves `DILOCO_SECRETS_MANAGER_REFS` ({"VAR": "secret-id"} or {"VAR": "secret-id#json-key"})
   through AWS Secrets Manager with the job's execution role — with boto3 if the image holds it,
   else with `secretsreader` (standard library) — so secret values never appear in the job's
   Environment (which anyone allowed to describe the job can read);
5. on a job of K > 1 instances (a replica of `nodes = K`), says which node this instance is:
   SageMaker writes /opt/ml/input/config/resourceconfig.json on every instance (`current_host`,
   and `hosts`: algo-1 … algo-K), and node r is the r-th host in lexicographic order, node 0
   hosting torch's store for the others (`node_placement`: torchrun's PET_NODE_RANK,
   PET_MASTER_ADDR, PET_MASTER_PORT, what `diloco.procgroup.node_env` gives on every platform);
6. runs the replica command it was given (the runner, or torchrun over L processes, on every
   node of a multi-node replica), forwarding SIGTERM/SIGINT (SageMaker's stop notice reaches
   this process, PID 1, alone) and passing its output through;
7. on failure writes "exit code N: <cause>" to /opt/ml/output/failure, which SageMaker returns
   as the job's FailureReason, and exits with the command's own code. On a multi-instance job
   each instance does this for itself; one instance failing fails the job, and SageMaker stops
   the others.

Standard library only: it must run before anything of the user's is importable.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
from collections import deque

ML_ROOT = "/opt/ml"
CHANNEL = "diloco"
ARCHIVE = "source.tar.gz"
WHEELS_DIR = "wheels"
SECRET_REFS_ENV = "DILOCO_SECRETS_MANAGER_REFS"
PIP_ENV = "DILOCO_PIP_INSTALL"  # a JSON list of requirements to install from the index ([backend] pip)
WHEELS_ENV = "DILOCO_WHEELS"  # a JSON list of requirements to install from the shipped wheels only
ENV_FILE_ENV = "DILOCO_ENV_FILE"  # a JSON file in the channel: {VAR: value} too long for the Environment
# Only diloco_sagemaker.testing sets it (its instances keep /opt/ml in a directory per job).
ML_ROOT_ENV = "DILOCO_ML_ROOT"
# Only diloco_sagemaker.testing sets it: its instances all run on one machine, where no name like
# "algo-2" resolves and every instance shares one loopback, so it says where each host's node
# port is reached there ({"algo-1": "127.0.0.1:41234", ...}). On SageMaker the host names resolve.
HOSTS_ENV = "DILOCO_SAGEMAKER_HOSTS"
EXIT_CONFIG = 78  # diloco.errors.EXIT_CONFIG: a relaunch would fail the same way
NODE_PORT = 29400  # diloco.procgroup.NODE_PORT (this file imports nothing of diloco): node 0's torch store


def paths(root: str = ML_ROOT) -> dict[str, str]:
    return {"channel": os.path.join(root, "input", "data", CHANNEL), "code": os.path.join(root, "code"),
            "failure": os.path.join(root, "output", "failure"),
            "resources": os.path.join(root, "input", "config", "resourceconfig.json")}


def node_placement(config: dict, reached: dict[str, str] | None = None) -> dict[str, str]:
    """This instance's node of a multi-instance job, as torchrun's own variables; {} for one instance.

    Node r is the r-th of `hosts` in lexicographic order and node 0 is the master: SageMaker
    writes `hosts` sorted so, and its training toolkit takes hosts[0] as the master and
    hosts.index(current_host) as the node rank. Sorted again here, so every instance agrees even
    if a file lists them otherwise (with 10 or more: algo-1, algo-10, algo-11, …, algo-2).
    `reached`: where a host's node port is reached instead of <host>:NODE_PORT (HOSTS_ENV).
    """
    hosts = config.get("hosts")
    current = config.get("current_host")
    if not isinstance(hosts, list) or not all(isinstance(h, str) and h for h in hosts) or len(set(hosts)) != len(hosts):
        raise ValueError(f"`hosts` is not a list of distinct host names: {hosts!r}")
    if len(hosts) <= 1:
        return {}
    hosts = sorted(hosts)
    if current not in hosts:
        raise ValueError(f"`current_host` {current!r} is not one of `hosts` {hosts}")
    address, port = hosts[0], NODE_PORT
    if reached and hosts[0] in reached:
        address, _, at = reached[hosts[0]].rpartition(":")
        port = int(at)
    return {"PET_NODE_RANK": str(hosts.index(current)), "PET_MASTER_ADDR": address, "PET_MASTER_PORT": str(port)}


def place_node(where: dict[str, str], env: dict[str, str]) -> str | None:
    """Step 5 on `env` (and one line in the log naming the node); the reason it cannot, or None."""
    if not os.path.exists(where["resources"]):
        return None  # not on a SageMaker instance: a one-node replica needs nothing (torchrun refuses a K > 1 one)
    try:
        with open(where["resources"]) as f:
            config = json.load(f)
        reached = json.loads(env.pop(HOSTS_ENV, "") or "{}")
        placement = node_placement(config, reached)
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        return f"cannot tell which node of the replica this instance is from {where['resources']}: {exc}"
    if placement:
        env.update(placement)
        print(f"diloco: node {placement['PET_NODE_RANK']} of {len(config['hosts'])} on {config['current_host']}; "
              f"node 0's store at {placement['PET_MASTER_ADDR']}:{placement['PET_MASTER_PORT']}", flush=True)
    return None


def unpack(archive: str, dest: str) -> None:
    os.makedirs(dest, exist_ok=True)
    with tarfile.open(archive, "r:gz") as tar:
        tar.extractall(dest, filter="data")


def resolve_secrets(refs: dict[str, str], region: str | None) -> dict[str, str]:
    """Secret values by variable name, read from Secrets Manager."""
    try:
        import boto3
    except ImportError:  # the image holds no boto3: one signed request with the standard library
        import secretsreader

        creds = secretsreader.credentials()
        read = lambda sid: secretsreader.get_secret_string(sid, region or "us-east-1", creds)  # noqa: E731
    else:
        client = boto3.client("secretsmanager")
        read = lambda sid: client.get_secret_value(SecretId=sid)["SecretString"]  # noqa: E731
    cache: dict[str, str] = {}
    out = {}
    for var, ref in refs.items():
        secret_id, _, key = ref.partition("#")
        if secret_id not in cache:
            cache[secret_id] = read(secret_id)
        out[var] = json.loads(cache[secret_id])[key] if key else cache[secret_id]
    return out


def describe(code: int, lines: list[str]) -> str:
    """The failure's cause, cause-first as diloco.bootstrap.failures reads it."""
    try:
        from diloco.bootstrap.failures import cause_from_log, signal_cause
    except ImportError:  # an image without diloco-core
        found = killed = None
    else:
        found, killed = cause_from_log("\n".join(lines)), signal_cause(code)
    last = next((x.strip() for x in reversed(lines) if x.strip()), "")
    return found or killed or f"the replica exited with code {code}; its last line: {last}"


def fail(where: dict[str, str], code: int, cause: str) -> int:
    print(f"diloco: error: {cause}", flush=True)
    os.makedirs(os.path.dirname(where["failure"]), exist_ok=True)
    with open(where["failure"], "w") as f:
        f.write(f"exit code {code}: {cause}"[:1000])
    return code


def pip_install(args: list[str], env: dict[str, str]) -> int:
    return subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-input", *args], env=env).returncode


def prepare(where: dict[str, str], env: dict[str, str]) -> str | None:
    """Steps 1-4 on `env`; the reason it cannot run the replica, or None."""
    env_file = env.pop(ENV_FILE_ENV, "")
    if env_file:
        with open(os.path.join(where["channel"], env_file)) as f:
            env.update(json.load(f))
    archive = os.path.join(where["channel"], ARCHIVE)
    if os.path.exists(archive):
        unpack(archive, where["code"])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (where["code"], env.get("PYTHONPATH")) if p)
        os.chdir(where["code"])
    wheels = json.loads(env.pop(WHEELS_ENV, "") or "[]")
    if wheels:
        found = os.path.join(where["channel"], WHEELS_DIR)
        code = pip_install(["--no-index", "--find-links", found, *wheels], env)
        if code:
            return (f"pip install --no-index --find-links {found} {' '.join(wheels)} failed (exit code {code}): the "
                    f"wheels shipped with the code do not install on this image's Python")
    packages = json.loads(env.pop(PIP_ENV, "") or "[]")
    if packages:
        code = pip_install(packages, env)
        if code:
            return (f"pip install {' '.join(packages)} failed (exit code {code}): [backend] pip needs a package "
                    f"index the job can reach (a VPC without NAT has none)")
    refs = json.loads(env.pop(SECRET_REFS_ENV, "") or "{}")
    if refs:
        try:
            env.update(resolve_secrets(refs, env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")))
        except Exception as exc:  # noqa: BLE001 - any failure here is the run's configuration
            return (f"cannot read secrets {sorted(refs)} from AWS Secrets Manager with the job's execution role: "
                    f"{type(exc).__name__}: {exc}")
    return None


def main(argv: list[str]) -> int:
    where = paths(os.environ.get(ML_ROOT_ENV) or ML_ROOT)
    if not argv:
        return fail(where, EXIT_CONFIG, "diloco bootstrap: no replica command given")
    env = dict(os.environ)
    problem = prepare(where, env)
    if problem:
        return fail(where, EXIT_CONFIG, problem)
    problem = place_node(where, env)
    if problem:  # the platform's file, not the spec: a relaunch (new instances) may read a good one
        return fail(where, 1, problem)
    child = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    tail: deque[str] = deque(maxlen=50)
    assert child.stdout is not None
    for raw in child.stdout:  # pass everything through to CloudWatch, remember the end
        sys.stdout.buffer.write(raw)
        sys.stdout.buffer.flush()
        tail.append(raw.decode("utf-8", "replace").rstrip("\n"))
    code = child.wait()
    if code < 0:
        code = 128 - code
    if not code:
        return 0
    cause = describe(code, list(tail))
    os.makedirs(os.path.dirname(where["failure"]), exist_ok=True)
    with open(where["failure"], "w") as f:
        f.write(f"exit code {code}: {cause}"[:1000])
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
