"""`FakeSageMaker`: the test control plane's HTTP endpoint and the controls a test holds.

One endpoint on 127.0.0.1 serves, for the launcher's shell (`env`):

- SageMaker's JSON API (`X-Amz-Target: SageMaker.<Operation>`), through `api.TrainingJobs`,
  after the caller's IAM permissions (`iam`): sagemaker:<Operation>, sagemaker:AddTags for tags,
  iam:PassRole for the execution role;
- S3, Secrets Manager and CloudWatch Logs, authorized the same way, then forwarded to moto
  (`gateway`);
- `GET /container-credentials/<job>`: the execution role's credentials for that job's container.

Every action it authorized is kept in `authorized`, so a test can hold the launcher to exactly
the permissions the README lists (`diloco_sagemaker.permissions`).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from .. import permissions
from .api import ApiError, TrainingJobs, role_credentials
from .gateway import authorize, denial, forward
from .iam import Authorizer, Denied, add_deny, create_launcher_identity, sagemaker_actions, signer
from .jobfiles import ACCOUNT, EXPIRE_REQUEST, INTERRUPT_REQUEST, describe, job_dir, pid_alive, pids, read_json, write_json

GRACE_SECONDS = 120.0  # SageMaker's: SIGTERM, then SIGKILL two minutes later
SPOT_WAIT_SECONDS = 3.0
NOT_FOUND_SECONDS = 1.0
STOPPING_SECONDS = 1.0  # how long a job shows Stopping after its container ended (SageMaker: tens of seconds)
LAUNCHER_USER = "diloco-launcher"


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):  # a client gone mid-request
            super().handle_error(request, client_address)


class FakeSageMaker:
    """`with FakeSageMaker(root, aws_endpoint=moto) as sm:` then give the launcher's shell `sm.env`
    (the endpoints, and the keys of an IAM user holding `launcher_policy`)."""

    def __init__(self, root: Path, *, aws_endpoint: str, region: str = "us-east-1",
                 grace_seconds: float = GRACE_SECONDS, spot_wait_seconds: float = SPOT_WAIT_SECONDS,
                 step_seconds: float = 0.2, not_found_seconds: float = NOT_FOUND_SECONDS,
                 stopping_seconds: float = STOPPING_SECONDS,
                 images: dict[str, list[str]] | None = None, launcher_policy: dict[str, Any] | None = None):
        self.root = Path(root)
        (self.root / "jobs").mkdir(parents=True, exist_ok=True)
        self.config = {"aws_endpoint": aws_endpoint, "region": region, "grace_seconds": grace_seconds,
                       "spot_wait_seconds": spot_wait_seconds, "step_seconds": step_seconds,
                       "not_found_seconds": not_found_seconds, "stopping_seconds": stopping_seconds, "images": dict(images or {}), "quotas": {},
                       "throttle": {}, "root": str(self.root), "endpoint": None}
        self.launcher_policy = launcher_policy or permissions.launcher_policy(account=ACCOUNT, region=region,
                                                                               bucket="*", role_arn="*")
        self.launcher_keys = create_launcher_identity(aws_endpoint, self.launcher_policy, LAUNCHER_USER)
        self.authorizer = Authorizer(aws_endpoint)
        self.authorized: list[str] = []  # every action an authorized call needed, in order
        self.jobs = TrainingJobs(self.root, self.config)
        self._server: _Server | None = None
        self._lock = threading.Lock()
        self._save_config()

    # -- test controls -------------------------------------------------------------------------

    def deny(self, action: str) -> None:
        """Take `action` ("CreateTrainingJob" means sagemaker:CreateTrainingJob) from the launcher."""
        add_deny(self.config["aws_endpoint"], LAUNCHER_USER, action if ":" in action else f"sagemaker:{action}")
        self.authorizer.forget()

    def quota(self, instance_type: str, instances: int) -> None:
        """The account's 'ml.x for training job usage' quota."""
        self._update(lambda c: c["quotas"].__setitem__(instance_type, instances))

    def throttle(self, operation: str, times: int) -> None:
        """The next `times` calls of SageMaker's `operation` answer ThrottlingException (HTTP 400)."""
        self._update(lambda c: c["throttle"].__setitem__(operation, times))

    def interrupt(self, job: str) -> bool:
        """A managed-spot interruption of `job`'s instance (SageMaker restarts the job itself)."""
        if (describe(self.root, job) or {}).get("TrainingJobStatus") != "InProgress":
            return False
        (job_dir(self.root, job) / INTERRUPT_REQUEST).write_text(str(time.time()))
        return True

    def expire(self, job: str, limit: str = "MaxRuntimeExceeded") -> bool:
        """`job` reaches its MaxRuntimeInSeconds (or, with "MaxWaitTimeExceeded", its
        MaxWaitTimeInSeconds) now: Stopping, its container ended as on a stop, then Stopped/`limit`."""
        if (describe(self.root, job) or {}).get("TrainingJobStatus") != "InProgress":
            return False
        (job_dir(self.root, job) / EXPIRE_REQUEST).write_text(limit)
        return True

    def kill(self, job: str, sig: int = signal.SIGKILL, host: str | None = None) -> bool:
        """Every process of the container dies of `sig` (an OOM kill, a crash): on instance `host`
        (algo-2, …), by default the job's first."""
        deadline = time.monotonic() + 5  # the instance records its container a moment after Training starts
        pid = None
        while not pid_alive(pid) and time.monotonic() < deadline:
            state = read_json(job_dir(self.root, job) / "state.json", {})
            if state.get("TrainingJobStatus") not in (None, "InProgress"):
                return False
            pid = (state.get("container_pids") or {}).get(host) if host else state.get("container_pid")
            time.sleep(0.05)
        if not pid_alive(pid):
            return False
        os.killpg(pid, sig)
        return True

    def job(self, name: str) -> dict[str, Any]:
        """The job as it is (no read lag); KeyError for a job never created."""
        found = describe(self.root, name)
        if found is None:
            raise KeyError(name)
        return found

    def received(self, name: str) -> dict[str, Any] | None:
        """The CreateTrainingJob request for job `name` exactly as the API received it (None: never created)."""
        req = read_json(job_dir(self.root, name) / "request.json")
        return None if req is None else {k: v for k, v in req.items() if k not in ("TrainingJobArn", "CreationTime")}

    def live_processes(self) -> list[int]:
        out = []
        for d in (self.root / "jobs").iterdir():
            out += [p for p in pids(d) if pid_alive(p)]
        return out

    # -- serving -------------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        assert self._server is not None, "use FakeSageMaker as a context manager"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    @property
    def env(self) -> dict[str, str]:
        """What the launcher's shell needs: every AWS endpoint it calls, and its identity."""
        ep = self.endpoint
        return {"AWS_ENDPOINT_URL_SAGEMAKER": ep, "AWS_ENDPOINT_URL_S3": ep, "AWS_ENDPOINT_URL_SECRETS_MANAGER": ep,
                "AWS_ENDPOINT_URL_CLOUDWATCH_LOGS": ep, **self.launcher_keys}

    def __enter__(self) -> FakeSageMaker:
        self._server = _Server(("127.0.0.1", 0), self._handler())
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self._update(lambda c: c.__setitem__("endpoint", self.endpoint))
        return self

    def __exit__(self, *exc: Any) -> None:
        for d in (self.root / "jobs").iterdir():
            for pid in pids(d):
                if pid_alive(pid):
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        plane = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline().strip():  # trailers
                                pass
                            return out
                        out += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _reply(self, status: int, headers: Any, body: bytes) -> None:
                self.send_response(status)
                for k, v in (headers.items() if isinstance(headers, dict) else headers):
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _serve(self) -> None:
                body = self._body()
                target = self.headers.get("X-Amz-Target", "")
                if self.command == "GET" and self.path.startswith("/container-credentials/"):
                    status, data = plane.credentials(self.path.rsplit("/", 1)[1])
                    return self._reply(status, {"Content-Type": "application/json"}, json.dumps(data).encode())
                if target.startswith("SageMaker."):
                    status, data = plane.sagemaker(target.partition(".")[2], body, self.headers)
                    headers = {"Content-Type": "application/x-amz-json-1.1"}
                    if status != 200:
                        headers["x-amzn-ErrorType"] = data["__type"]
                    return self._reply(status, headers, json.dumps(data, default=str).encode())
                try:
                    authorize(plane.authorizer, self.command, self.path, self.headers, body, plane.authorized)
                except Denied as exc:
                    return self._reply(*denial(self.headers, exc))
                self._reply(*forward(plane.config["aws_endpoint"], self.command, self.path, self.headers, body))

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _serve

        return Handler

    # -- the API -------------------------------------------------------------------------------

    def sagemaker(self, operation: str, body: bytes, headers: Any) -> tuple[int, dict[str, Any]]:
        self.config = read_json(self.root / "config.json", self.config)
        self.jobs.config = self.config
        try:
            try:
                req = json.loads(body or b"{}")
            except ValueError:
                raise ApiError("SerializationException", "the request body is not JSON") from None
            who = signer(headers.get("Authorization"))
            if who is None:
                raise ApiError("MissingAuthenticationTokenException", "Missing Authentication Token", 403)
            for action, resource in sagemaker_actions(operation, req, self.config["region"]):
                try:
                    self.authorizer.authorize(who[0], action, resource)
                except Denied as exc:
                    raise ApiError(exc.code, exc.message) from None
                self.authorized.append(action)
            self._maybe_throttle(operation)
            return 200, self.jobs.handle(operation, req)
        except ApiError as exc:
            return exc.status, {"__type": exc.code, "message": exc.message}

    def _maybe_throttle(self, operation: str) -> None:
        with self._lock:
            config = read_json(self.root / "config.json", self.config)
            left = config["throttle"].get(operation, 0)
            if left > 0:
                config["throttle"][operation] = left - 1
                write_json(self.root / "config.json", config)
                raise ApiError("ThrottlingException", "Rate exceeded")

    def credentials(self, job: str) -> tuple[int, dict[str, Any]]:
        try:
            return 200, role_credentials(self.config, self.root, job)
        except ApiError as exc:
            return exc.status, {"message": exc.message}

    def _update(self, change: Any) -> None:
        with self._lock:
            self.config = read_json(self.root / "config.json", self.config)
            change(self.config)
            self.jobs.config = self.config
            self._save_config()

    def _save_config(self) -> None:
        write_json(self.root / "config.json", self.config)
