"""One training job's instance in the test control plane: `python -m diloco_sagemaker.testing.instance JOBDIR CONFIG`.

Does what SageMaker does with a job (see the package docstring): statuses, channels, /opt/ml,
the container, CloudWatch Logs, output upload, time limits, stop and spot interruption. Its
state is JOBDIR/state.json, read by the control plane for DescribeTrainingJob.
"""

from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

from . import INTERRUPT_REQUEST, STOP_REQUEST, read_json, write_json

LOG_GROUP = "/aws/sagemaker/TrainingJobs"
HOST = "algo-1"
ROLE_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}  # the execution role's


class Instance:
    def __init__(self, jobdir: Path, config: dict[str, Any]):
        import boto3

        self.dir, self.config = jobdir, config
        self.req = read_json(jobdir / "request.json")
        self.name = self.req["TrainingJobName"]
        kw = {"endpoint_url": config["aws_endpoint"], "region_name": config["region"], **{
            "aws_access_key_id": "testing", "aws_secret_access_key": "testing"}}
        self.s3, self.logs = boto3.client("s3", **kw), boto3.client("logs", **kw)
        self.training_seconds = 0.0
        self.container: subprocess.Popen | None = None

    @property
    def flag(self) -> str | None:
        """"stop" (StopTrainingJob) or "interrupt" (a spot interruption): requests the control plane
        leaves as files, so one that arrives while this process is still starting is not lost."""
        if (self.dir / STOP_REQUEST).exists():
            return "stop"
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

    # -- the job -------------------------------------------------------------------------------

    def run(self) -> None:
        created = self.req["CreationTime"]
        limits = self.req["StoppingCondition"]
        while True:
            self.pause()
            if self.flag == "stop":
                return self.stopped("Stopped")
            self.set("InProgress", "Starting", "Preparing the instances for training")
            self.pause()
            ml = self.fresh_ml_root()
            self.set("InProgress", "Downloading", "Downloading input data")
            self.download_channels(ml)
            if self.flag == "stop":
                return self.stopped("Stopped")
            self.set("InProgress", "Training", "Training image download completed. Training in progress.",
                     TrainingStartTime=self.state().get("TrainingStartTime") or time.time())
            outcome, code = self.train(ml, created, limits)
            if outcome == "interrupt":
                self.set("InProgress", "Interrupted", "Spot instance was interrupted; waiting for capacity")
                end = time.monotonic() + self.config["spot_wait_seconds"]
                while time.monotonic() < end and self.flag != "stop":
                    time.sleep(0.1)
                if self.flag == "stop":
                    return self.stopped("Stopped")
                (self.dir / INTERRUPT_REQUEST).unlink(missing_ok=True)
                self.set("InProgress", "Restarting", "Restarting the job on new spot capacity")
                continue
            if outcome in ("stop", "MaxRuntimeExceeded", "MaxWaitTimeExceeded"):
                return self.stopped("Stopped" if outcome == "stop" else outcome)
            if code == 0:
                self.set("InProgress", "Uploading", "Uploading generated training model")
                self.upload_model(ml)
                return self.ended("Completed", "Completed", "Training job completed")
            failure = ml / "output" / "failure"
            reason = failure.read_text()[:1024] if failure.exists() else f", exit code: {code}"
            return self.ended("Failed", "Failed", "Training job failed", FailureReason=f"AlgorithmError: {reason}")

    def stopped(self, secondary: str) -> None:
        if secondary == "Stopped":
            self.set("Stopping", "Stopping", "Stopping the training job")
            self.pause()
        self.ended("Stopped", secondary, "Training job stopped")

    def ended(self, status: str, secondary: str, message: str, **extra: Any) -> None:
        self.set(status, secondary, message, TrainingEndTime=time.time(),
                 TrainingTimeInSeconds=int(self.training_seconds), BillableTimeInSeconds=int(self.training_seconds),
                 container_pid=None, **extra)

    def fresh_ml_root(self) -> Path:
        """A new instance's /opt/ml (after a spot interruption nothing local survives)."""
        ml = self.dir / "opt-ml"
        shutil.rmtree(ml, ignore_errors=True)
        for sub in ("input/config", "input/data", "model", "output/data", "code"):
            (ml / sub).mkdir(parents=True, exist_ok=True)
        channels = {c["ChannelName"]: {"TrainingInputMode": c.get("InputMode", "File"), "S3DistributionType":
                                       c["DataSource"]["S3DataSource"].get("S3DataDistributionType")}
                    for c in self.req.get("InputDataConfig", [])}
        write_json(ml / "input/config/inputdataconfig.json", channels)
        write_json(ml / "input/config/hyperparameters.json", self.req.get("HyperParameters") or {})
        write_json(ml / "input/config/resourceconfig.json", {
            "current_host": HOST, "hosts": [HOST], "current_group_name": "homogeneousCluster",
            "current_instance_type": self.req["ResourceConfig"]["InstanceType"], "network_interface_name": "eth0"})
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

    def container_env(self, ml: Path) -> dict[str, str]:
        path = os.pathsep.join([self.config["python_bin"], "/usr/local/bin", "/usr/bin", "/bin"])
        env = {"PATH": path, "HOME": str(self.dir), "LANG": "C.UTF-8", "TRAINING_JOB_NAME": self.name,
               "TRAINING_JOB_ARN": self.req["TrainingJobArn"], "DILOCO_ML_ROOT": str(ml), **ROLE_CREDENTIALS}
        env.update(self.req.get("Environment") or {})
        return env

    def command(self, ml: Path) -> list[str]:
        spec = self.req["AlgorithmSpecification"]
        argv = list(spec.get("ContainerEntrypoint") or ["train"]) + list(spec.get("ContainerArguments") or [])
        return [a.replace("/opt/ml", str(ml)) for a in argv]

    def train(self, ml: Path, created: float, limits: dict[str, int]) -> tuple[str, int | None]:
        """Run the container to its end; ("exited", code), or why it was ended from outside."""
        stream = f"{self.name}/{HOST}-{int(time.time() * 1000)}"
        shipper = LogShipper(self.logs, stream, self.dir / "container.log")
        self.container = subprocess.Popen(self.command(ml), env=self.container_env(ml), cwd=str(ml),
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        state = self.state()
        state["container_pid"] = self.container.pid
        write_json(self.dir / "state.json", state)
        reader = threading.Thread(target=shipper.pump, args=(self.container.stdout,), daemon=True)
        reader.start()
        started = time.monotonic()
        outcome = "exited"
        while self.container.poll() is None:
            elapsed = self.training_seconds + time.monotonic() - started
            if self.flag in ("stop", "interrupt"):
                outcome = self.flag
            elif elapsed > limits["MaxRuntimeInSeconds"]:
                outcome = "MaxRuntimeExceeded"
            elif limits.get("MaxWaitTimeInSeconds") and time.time() - created > limits["MaxWaitTimeInSeconds"]:
                outcome = "MaxWaitTimeExceeded"
            if outcome != "exited":
                self.end_container()
                break
            time.sleep(0.1)
        code = self.container.wait()
        self.training_seconds += time.monotonic() - started
        reader.join(timeout=10)
        shipper.close()
        return outcome, (128 - code if code < 0 else code)

    def end_container(self) -> None:
        """SIGTERM, then SIGKILL after the grace period (SageMaker gives 120 s)."""
        assert self.container is not None
        try:
            os.killpg(self.container.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + self.config["grace_seconds"]
        while self.container.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        try:
            os.killpg(self.container.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def upload_model(self, ml: Path) -> None:
        out = self.req["OutputDataConfig"]["S3OutputPath"].rstrip("/")
        bucket, _, prefix = out[len("s3://"):].partition("/")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            tar.add(str(ml / "model"), arcname=".")
        key = "/".join(p for p in (prefix, self.name, "output", "model.tar.gz") if p)
        self.s3.put_object(Bucket=bucket, Key=key, Body=buf.getvalue())


class LogShipper:
    """Container output → CloudWatch Logs (one event per line, batched), and a local copy."""

    def __init__(self, logs: Any, stream: str, local: Path):
        self.logs, self.stream, self.local = logs, stream, open(local, "ab")
        try:
            logs.create_log_group(logGroupName=LOG_GROUP)
        except logs.exceptions.ResourceAlreadyExistsException:
            pass
        logs.create_log_stream(logGroupName=LOG_GROUP, logStreamName=stream)
        self.pending: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.done = threading.Event()
        threading.Thread(target=self._flush_every, args=(0.3,), daemon=True).start()

    def _flush_every(self, seconds: float) -> None:
        """Like the CloudWatch agent: lines show up within a moment even when output pauses."""
        while not self.done.wait(seconds):
            self.flush()

    def pump(self, pipe: Any) -> None:
        for raw in pipe:
            self.local.write(raw)
            self.local.flush()
            line = raw.decode("utf-8", "replace").rstrip("\n")
            with self.lock:
                self.pending.append({"timestamp": int(time.time() * 1000), "message": line})
            if len(self.pending) >= 100:
                self.flush()
        self.flush()

    def flush(self) -> None:
        with self.lock:  # one batch at a time, in order
            batch, self.pending = self.pending, []
            if batch:
                self.logs.put_log_events(logGroupName=LOG_GROUP, logStreamName=self.stream, logEvents=batch)

    def close(self) -> None:
        self.done.set()
        self.flush()
        self.local.close()


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
