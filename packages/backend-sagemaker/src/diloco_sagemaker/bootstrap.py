"""The first thing a diloco training job runs (its ContainerEntrypoint); uploaded beside the code.

SageMaker downloads the job's `diloco` input channel to /opt/ml/input/data/diloco/ before the
container starts: this file and, unless the code is baked into the image, `source.tar.gz` (the
spec's workdir). It then:

1. unpacks the workdir into /opt/ml/code (data-only extraction: no absolute paths, links out
   of the tree or device files) and puts it first on PYTHONPATH;
2. installs `DILOCO_PIP_INSTALL` (diloco itself on an official PyTorch image, `[backend] pip`);
3. resolves `DILOCO_SECRETS_MANAGER_REFS` ({"VAR": "secret-id"} or {"VAR": "secret-id#json-key"}) through
   AWS Secrets Manager with the job's execution role, so secret values never appear in the
   job's Environment (which anyone allowed to describe the job can read);
4. runs the replica command it was given (the runner, or torchrun over L processes), forwarding
   SIGTERM/SIGINT (SageMaker's stop notice) and passing its output through;
5. on failure writes "exit code N: <cause>" to /opt/ml/output/failure, which SageMaker returns
   as the job's FailureReason, and exits with the command's own code.

Standard library only, plus boto3 when secrets are referenced (every SageMaker image has it):
it must run before anything of the user's is importable.
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
SECRET_REFS_ENV = "DILOCO_SECRETS_MANAGER_REFS"
PIP_ENV = "DILOCO_PIP_INSTALL"  # a JSON list of packages to install first (an official image lacks diloco)
# Only diloco_sagemaker.testing sets it (its instances keep /opt/ml in a directory per job).
ML_ROOT_ENV = "DILOCO_ML_ROOT"
EXIT_CONFIG = 78  # diloco.errors.EXIT_CONFIG: a relaunch would fail the same way


def paths(root: str = ML_ROOT) -> dict[str, str]:
    return {"channel": os.path.join(root, "input", "data", CHANNEL), "code": os.path.join(root, "code"),
            "failure": os.path.join(root, "output", "failure")}


def unpack(archive: str, dest: str) -> None:
    os.makedirs(dest, exist_ok=True)
    with tarfile.open(archive, "r:gz") as tar:
        tar.extractall(dest, filter="data")


def resolve_secrets(refs: dict[str, str]) -> dict[str, str]:
    """Secret values by variable name, read from Secrets Manager."""
    import boto3

    client = boto3.client("secretsmanager")
    cache: dict[str, str] = {}
    out = {}
    for var, ref in refs.items():
        secret_id, _, key = ref.partition("#")
        if secret_id not in cache:
            cache[secret_id] = client.get_secret_value(SecretId=secret_id)["SecretString"]
        out[var] = json.loads(cache[secret_id])[key] if key else cache[secret_id]
    return out


def describe(code: int, lines: list[str]) -> str:
    """The failure's cause, cause-first as diloco.failures reads it."""
    try:
        from diloco.failures import cause_from_log, signal_cause
    except ImportError:  # an image without diloco-core
        found = killed = None
    else:
        found, killed = cause_from_log("\n".join(lines)), signal_cause(code)
    last = next((x.strip() for x in reversed(lines) if x.strip()), "")
    return found or killed or f"the replica exited with code {code}; its last line: {last}"


def fail(where: dict[str, str], code: int, cause: str) -> int:
    os.makedirs(os.path.dirname(where["failure"]), exist_ok=True)
    with open(where["failure"], "w") as f:
        f.write(f"exit code {code}: {cause}"[:1000])
    return code


def main(argv: list[str]) -> int:
    where = paths(os.environ.get(ML_ROOT_ENV) or ML_ROOT)
    if not argv:
        return fail(where, EXIT_CONFIG, "diloco bootstrap: no replica command given")
    env = dict(os.environ)
    archive = os.path.join(where["channel"], ARCHIVE)
    if os.path.exists(archive):
        unpack(archive, where["code"])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (where["code"], env.get("PYTHONPATH")) if p)
        os.chdir(where["code"])
    packages = json.loads(env.pop(PIP_ENV, "") or "[]")
    if packages:
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-input", *packages], env=env)
        if done.returncode:
            return fail(where, EXIT_CONFIG, f"pip install {' '.join(packages)} failed (exit code {done.returncode})")
    refs = json.loads(env.pop(SECRET_REFS_ENV, "") or "{}")
    if refs:
        try:
            env.update(resolve_secrets(refs))
        except Exception as exc:  # noqa: BLE001 - any failure here is the run's configuration
            msg = f"cannot read secrets {sorted(refs)} from AWS Secrets Manager: {type(exc).__name__}: {exc}"
            print(f"diloco: error: {msg}", flush=True)
            return fail(where, EXIT_CONFIG, msg)
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
    return fail(where, code, describe(code, list(tail))) if code else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
