"""One training job's instances: `python -m diloco_sagemaker.testing.instance JOBDIR CONFIG`.

Does with a job what SageMaker documents (DescribeTrainingJob's SecondaryStatus, managed spot
training, StopTrainingJob), writing JOBDIR/state.json for DescribeTrainingJob:

- InProgress: Starting → Downloading (the input channels, from S3 into each instance's
  /opt/ml/input/data/<channel>/) → DownloadingTrainingImage (the image's interpreter, `images`)
  → Training → Uploading (/opt/ml/model) → Completed; or Failed, with FailureReason from the
  failed instance's /opt/ml/output/failure;
- StopTrainingJob: Stopping → Stopped. MaxRuntimeInSeconds reached (training time) or
  MaxWaitTimeInSeconds reached (time since creation, waiting for spot capacity included):
  Stopping → Stopped with SecondaryStatus MaxRuntimeExceeded / MaxWaitTimeExceeded;
- a spot interruption: InProgress/Interrupted, then after a wait InProgress/Starting again on
  fresh instances (a fresh /opt/ml each), with new log streams;
- ending a container: SIGTERM to its PID 1 only (the entrypoint; it forwards to its children if
  it wants to), then after the grace period (SageMaker: 120 seconds) SIGKILL to every process
  of the container. When PID 1 exits, whatever it left running dies with the container.

A job of InstanceCount K runs K containers, one per instance (algo-1 … algo-K, `containers`),
each its own process group with its own resourceconfig.json. The job completes when every
container exited 0; when one exits otherwise the job fails: the others are ended as on a stop
and FailureReason is the failed instance's. A stop, a time limit or a spot interruption ends
them all.

Each container runs ContainerEntrypoint + ContainerArguments with the job's Environment, the
image's interpreter first on PATH, /opt/ml mapped to a directory per instance (DILOCO_ML_ROOT
tells diloco's bootstrap), where each host's node port is reached on this machine
(DILOCO_SAGEMAKER_HOSTS, see `containers`), the execution role's credentials from a container
credentials endpoint (AWS_CONTAINER_CREDENTIALS_FULL_URI, served by the control plane) and no
package index (PIP_INDEX_URL points nowhere: a VPC without NAT).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

from . import images
from .containers import HOSTS_ENV, Container, host_names, reached_at, record_pids, resource_config
from .jobfiles import EXPIRE_REQUEST, INTERRUPT_REQUEST, STOP_REQUEST, read_json, write_json

NO_INDEX = "http://127.0.0.1:9/simple/"  # nothing listens there: pip fails fast, as without internet
TIME_LIMITS = ("MaxRuntimeExceeded", "MaxWaitTimeExceeded")


class Instance:
    def __init__(self, jobdir: Path, config: dict[str, Any]):
        import boto3

        self.dir, self.config = jobdir, config
        self.req = read_json(jobdir / "request.json")
        self.name = self.req["TrainingJobName"]
        kw = {"endpoint_url": config["aws_endpoint"], "region_name": config["region"],
              "aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
        self.s3, self.logs = boto3.client("s3", **kw), boto3.client("logs", **kw)
        self.training_seconds = 0.0
        self.hosts = host_names(int(self.req["ResourceConfig"].get("InstanceCount") or 1))
        self.containers: list[Container] = []

    @property
    def flag(self) -> str | None:
        """"stop" (StopTrainingJob), "interrupt" (a spot interruption) or a time limit a test makes
        the job reach now ("MaxRuntimeExceeded"), left as files by the plane."""
        if (self.dir / STOP_REQUEST).exists():
            return "stop"
        if (self.dir / EXPIRE_REQUEST).exists():
            return (self.dir / EXPIRE_REQUEST).read_text().strip() or "MaxRuntimeExceeded"
        return "interrupt" if (self.dir / INTERRUPT_REQUEST).exists() else None

    # -- state ---------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        return read_json(self.dir / "state.json", {})

    def set(self, status: str, secondary: str, message: str = "", **extra: Any) -> None:
        state = self.state()
        state.update(extra)
        state["TrainingJobStatus"], state["SecondaryStatus"] = status, secondary
        if not state.get("transitions") or state["transitions"][-1]["Status"] != secondary:
            state.setdefault("transitions", []).append({"Status": secondary, "StartTime": time.time(),
                                                        "StatusMessage": message})
        write_json(self.dir / "state.json", state)

    def pause(self) -> None:
        time.sleep(self.config["step_seconds"])

    def wait_exceeded(self) -> bool:
        limit = self.req["StoppingCondition"].get("MaxWaitTimeInSeconds")
        return bool(limit) and time.time() - self.req["CreationTime"] > limit

    # -- the job -------------------------------------------------------------------------------

    def run(self) -> None:
        limits = self.req["StoppingCondition"]
        while True:
            self.pause()
            if self.flag == "stop":
                return self.stop_before_training("Stopped")
            if self.wait_exceeded():
                return self.stop_before_training("MaxWaitTimeExceeded")
            self.set("InProgress", "Starting", "Preparing the instances for training")
            self.pause()
            self.containers = [Container(self.dir, host, host == self.hosts[0]) for host in self.hosts]
            for c in self.containers:
                self.fresh_ml_root(c)
            self.set("InProgress", "Downloading", "Downloading input data")
            for c in self.containers:
                self.download_channels(c.ml)
            self.set("InProgress", "DownloadingTrainingImage", "Downloading the training image")
            bindirs = [self.start_image(c) for c in self.containers]
            if self.flag == "stop":
                return self.stop_before_training("Stopped")
            self.set("InProgress", "Training", "Training image download completed. Training in progress.",
                     TrainingStartTime=self.state().get("TrainingStartTime") or time.time())
            outcome, failed, code = self.train(bindirs, limits)
            if outcome == "interrupt":
                end = time.monotonic() + self.config["spot_wait_seconds"]
                while time.monotonic() < end and self.flag != "stop" and not self.wait_exceeded():
                    time.sleep(0.1)
                if self.flag == "stop" or self.wait_exceeded():
                    return self.stop_before_training("Stopped" if self.flag == "stop" else "MaxWaitTimeExceeded")
                (self.dir / INTERRUPT_REQUEST).unlink(missing_ok=True)
                continue  # back to Starting, on new capacity
            if outcome == "stop" or outcome in TIME_LIMITS:
                return self.ended("Stopped", "Stopped" if outcome == "stop" else outcome, "Training job stopped")
            if failed is None:
                self.set("InProgress", "Uploading", "Uploading generated training model")
                self.upload_model()
                return self.ended("Completed", "Completed", "Training job completed")
            reason = failed.failure() or f", exit code: {code}"
            return self.ended("Failed", "Failed", "Training job failed", FailureReason=f"AlgorithmError: {reason}")

    def stop_before_training(self, secondary: str) -> None:
        """Stopped while no container runs (starting, or waiting for spot capacity)."""
        self.set("Stopping", "Stopping", "Stopping the training job")
        time.sleep(self.config["stopping_seconds"])
        self.ended("Stopped", secondary, "Training job stopped")

    def ended(self, status: str, secondary: str, message: str, **extra: Any) -> None:
        self.set(status, secondary, message, TrainingEndTime=time.time(),
                 TrainingTimeInSeconds=int(self.training_seconds), BillableTimeInSeconds=int(self.training_seconds),
                 container_pid=None, container_pids=None, **extra)

    def fresh_ml_root(self, container: Container) -> Path:
        """A new instance's /opt/ml (after a spot interruption nothing local survives)."""
        ml = container.ml
        shutil.rmtree(ml, ignore_errors=True)
        for sub in ("input/config", "input/data", "model", "output/data", "code"):
            (ml / sub).mkdir(parents=True, exist_ok=True)
        channels = {c["ChannelName"]: {"TrainingInputMode": c.get("InputMode", "File"), "S3DistributionType":
                                       c["DataSource"]["S3DataSource"].get("S3DataDistributionType")}
                    for c in self.req.get("InputDataConfig", [])}
        write_json(ml / "input/config/inputdataconfig.json", channels)
        write_json(ml / "input/config/hyperparameters.json", self.req.get("HyperParameters") or {})
        write_json(ml / "input/config/resourceconfig.json",
                   resource_config(container.host, self.hosts, self.req["ResourceConfig"]["InstanceType"]))
        return ml

    def download_channels(self, ml: Path) -> None:
        for channel in self.req.get("InputDataConfig", []):
            uri = channel["DataSource"]["S3DataSource"]["S3Uri"]
            bucket, _, prefix = uri[len("s3://"):].partition("/")
            dest = ml / "input" / "data" / channel["ChannelName"]
            dest.mkdir(parents=True, exist_ok=True)
            pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
            for obj in (o for page in pages for o in page.get("Contents", [])):
                rel = obj["Key"][len(prefix):].lstrip("/") or obj["Key"].rsplit("/", 1)[-1]
                target = dest / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                self.s3.download_file(bucket, obj["Key"], str(target))

    def start_image(self, container: Container) -> Path:
        """The image's interpreter for this start of an instance: a fresh container over the image's layer."""
        image = self.req["AlgorithmSpecification"]["TrainingImage"]
        layer = images.image_layer(Path(self.config["root"]), image, self.config.get("images"))
        return images.container_python(layer, container.venv)

    def container_env(self, ml: Path, bindir: Path, reached: dict[str, str]) -> dict[str, str]:
        path = os.pathsep.join([str(bindir), "/usr/local/bin", "/usr/bin", "/bin"])
        env = {"PATH": path, "HOME": str(self.dir), "LANG": "C.UTF-8", "TRAINING_JOB_NAME": self.name,
               "TRAINING_JOB_ARN": self.req["TrainingJobArn"], "DILOCO_ML_ROOT": str(ml),
               "AWS_CONTAINER_CREDENTIALS_FULL_URI": f"{self.config['endpoint']}/container-credentials/{self.name}",
               "PIP_INDEX_URL": NO_INDEX, "PIP_RETRIES": "0", "PIP_TIMEOUT": "2",
               "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_CACHE_DIR": "1",
               # AWS's own network: a real container reaches secretsmanager.<region>.amazonaws.com by DNS
               # before any of the job's secrets exist (an S3 endpoint, if the run has one, is among them)
               "AWS_ENDPOINT_URL_SECRETS_MANAGER": self.config["aws_endpoint"]}
        if len(self.hosts) > 1:  # one machine: where each host's node port is reached here (see `containers`)
            env[HOSTS_ENV] = json.dumps(reached)
        env.update(self.req.get("Environment") or {})
        return env

    def command(self) -> list[str]:
        spec = self.req["AlgorithmSpecification"]
        return list(spec.get("ContainerEntrypoint") or ["train"]) + list(spec.get("ContainerArguments") or [])

    def train(self, bindirs: list[Path], limits: dict[str, int]) -> tuple[str, Container | None, int | None]:
        """Run the containers to their end: ("exited", the first container that failed or None, its
        code), or why they were ended from outside."""
        reached = reached_at(self.hosts)
        for c, bindir in zip(self.containers, bindirs):
            c.start(self.command(), self.container_env(c.ml, bindir, reached), self.logs, self.name)
        record_pids(self.dir / "state.json", self.state(), self.containers)
        started = time.monotonic()
        outcome, failed = "exited", None
        while any(c.poll() is None for c in self.containers):
            failed = next((c for c in self.containers if c.poll() not in (None, 0)), None)
            if self.flag in ("stop", "interrupt", *TIME_LIMITS):
                outcome = self.flag
            elif self.training_seconds + time.monotonic() - started > limits["MaxRuntimeInSeconds"]:
                outcome = "MaxRuntimeExceeded"
            elif self.wait_exceeded():
                outcome = "MaxWaitTimeExceeded"
            if outcome != "exited" or failed is not None:
                if outcome == "interrupt":
                    self.set("InProgress", "Interrupted", "Spot instance was interrupted; waiting for capacity")
                elif outcome != "exited":
                    self.set("Stopping", "Stopping", "Stopping the training job")
                self.end_containers()  # one instance failed: the job fails, the others are stopped
                if outcome not in ("exited", "interrupt"):
                    time.sleep(self.config["stopping_seconds"])  # SageMaker uploads and tears down meanwhile
                break
            time.sleep(0.1)
        codes = [c.finish() for c in self.containers]  # each PID 1 gone: so is its container, and all it ran
        self.training_seconds += time.monotonic() - started
        if failed is None and outcome == "exited":
            failed = next((c for c, code in zip(self.containers, codes) if code), None)
        return outcome, failed, (codes[self.containers.index(failed)] if failed else 0)

    def end_containers(self) -> None:
        """Every container still running ended at once: SIGTERM to each PID 1, SIGKILL after the grace period."""
        ends = [threading.Thread(target=c.end, args=(self.config["grace_seconds"],)) for c in self.containers
                if c.poll() is None]
        for t in ends:
            t.start()
        for t in ends:
            t.join()

    def upload_model(self) -> None:
        """One model.tar.gz of every instance's /opt/ml/model (the stand-in's merge: later hosts' files
        after earlier ones'; SageMaker's advice is to write the model on one host)."""
        out = self.req["OutputDataConfig"]["S3OutputPath"].rstrip("/")
        bucket, _, prefix = out[len("s3://"):].partition("/")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            for c in self.containers:
                tar.add(str(c.ml / "model"), arcname=".")
        key = "/".join(p for p in (prefix, self.name, "output", "model.tar.gz") if p)
        self.s3.put_object(Bucket=bucket, Key=key, Body=buf.getvalue())


def main(argv: list[str]) -> int:
    jobdir, config = Path(argv[0]), read_json(Path(argv[1]))
    try:
        Instance(jobdir, config).run()
    except Exception as exc:  # noqa: BLE001 - an instance that breaks is a failed job, visible as such
        state = read_json(jobdir / "state.json", {})
        state.update({"TrainingJobStatus": "Failed", "SecondaryStatus": "Failed",
                      "FailureReason": f"InternalServerError: the test instance broke: {type(exc).__name__}: {exc}"})
        write_json(jobdir / "state.json", state)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
