"""Conformance kit: the protocol's contract as tests any backend package can run.

A backend proves it honours the executor contract by subclassing `ExecutorConformance` in its
own test suite and saying how to build an executor::

    from diloco.testing import ExecutorConformance

    class TestFooConformance(ExecutorConformance):
        def make_executor(self):
            return FooExecutor(namespace="test")

`make_executor` is called more than once per test: a second instance stands for another
process, so durable handles are checked for real. Override `wait_timeout` for slow backends, and `setup_method`/fixtures for
whatever stand-ins the backend's tests need (a Kubernetes API emulator, an S3 server).

`launch` and `plan_for` are also the shortest way to start replicas from a backend's own tests.

Every check fails with the rule that was broken and the section of docs/writing-a-backend.md
that states it (`require`), never a bare AssertionError: a backend's authors read the kit's
failures, not its source. Plain `assert` would say nothing here, since pytest rewrites only the
asserts of test modules, not of an installed package's.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import signal
import time
import uuid
from pathlib import Path
from typing import Any

from diloco.plugins.discovery import backend_options
from diloco.protocol import OPTIONAL_METHODS, Capabilities, Executor, ReplicaHandle, ReplicaStatus
from diloco.request import LaunchPlan, LaunchRequest, Secrets

REPORT = "diloco.testing.entrypoints:report"
FAIL_ON = "diloco.testing.entrypoints:fail_on"
SLEEP = "diloco.testing.entrypoints:sleep"
SECRET_VALUE = "conformance-secret-value-7f3a"
GUIDE = "docs/writing-a-backend.md"
CLOUDS = ("aws", "gcp", "azure")  # the clouds `diloco.spec.estimate` has prices for


def require(ok: object, broken: str, section: str) -> None:
    """Fail the check with what was broken and where the guide states the rule (`section`: an anchor)."""
    if not ok:
        raise AssertionError(f"{broken} (see {GUIDE}{section})")


def process_alive(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie counts as dead), for process-tree assertions."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def request_for(n_replicas: int, entrypoint: Any, args: dict[str, Any] | None = None, *,
                secret_env: dict[str, str] | None = None, ranks: Any = None, run_id: str | None = None,
                **fields: Any) -> LaunchRequest:
    """A `LaunchRequest` from the short form tests write (`secret_env` for the secrets)."""
    return LaunchRequest(run_id=run_id or f"test-{uuid.uuid4().hex[:8]}", n_replicas=n_replicas,
                         entrypoint=entrypoint, args=dict(args or {}), secrets=Secrets(secret_env),
                         ranks=tuple(ranks or ()), **fields)


def plan_for(executor: Any, n_replicas: int, entrypoint: Any, args: dict[str, Any] | None = None,
             **fields: Any) -> LaunchPlan:
    """What `diloco dryrun` would print for such a launch on `executor`."""
    return executor.plan(request_for(n_replicas, entrypoint, args, **fields))


def launch(executor: Any, n_replicas: int, entrypoint: Any, args: dict[str, Any] | None = None,
           **fields: Any) -> list[ReplicaHandle]:
    """Plan and submit, as `diloco run` does; the handles in rank order."""
    return executor.submit(executor.plan(request_for(n_replicas, entrypoint, args, **fields)))


def wait_for_status(executor: Any, handle: ReplicaHandle, wanted: set[str], timeout: float = 60) -> str:
    """Poll `handle` until its status is one of `wanted` (or `timeout` passes); the last status."""
    deadline = time.monotonic() + timeout
    status = executor.poll(handle)
    while status.value not in wanted and time.monotonic() < deadline:
        time.sleep(0.1)
        status = executor.poll(handle)
    return status.value


def wait_for_output(executor: Any, handle: ReplicaHandle, text: str, timeout: float = 60) -> str:
    """Poll `handle`'s logs until they hold `text` (or `timeout` passes); the last logs.

    What a test waits for before acting on a replica *inside* its entrypoint (a preemption
    notice, a kill): a `running` status only says the platform started it, and may lag (Modal's
    call graph), so a notice timed from it can land before the runner set its handlers or after
    the entrypoint already returned."""
    deadline = time.monotonic() + timeout
    logs = executor.stream_logs(handle)
    while text not in logs and time.monotonic() < deadline:
        time.sleep(0.1)
        logs = executor.stream_logs(handle)
    return logs


class ExecutorConformance(abc.ABC):
    n_replicas = 3
    wait_timeout = 60.0

    @abc.abstractmethod
    def make_executor(self) -> Executor:
        """A fresh executor instance (called more than once: a second one stands for another process)."""

    # helpers ------------------------------------------------------------------------------

    def run_id(self) -> str:
        return f"conf-{uuid.uuid4().hex[:8]}"

    def executor(self) -> Executor:
        return self.make_executor()

    def launch(self, executor: Executor, entrypoint: str, args: dict[str, Any] | None = None,
               **kwargs: Any) -> list[ReplicaHandle]:
        kwargs.setdefault("run_id", self.run_id())
        kwargs.setdefault("timeout", 120)
        return launch(executor, kwargs.pop("n", self.n_replicas), entrypoint, args, **kwargs)

    def wait_until(self, executor: Executor, handle: ReplicaHandle, wanted: set[str]) -> str:
        return wait_for_status(executor, handle, wanted, timeout=self.wait_timeout)

    def check_handles(self, handles: list[ReplicaHandle], run_id: str, ranks: list[int], attempt: int) -> None:
        """Handles in rank order, carrying the keys core reads (`run_id`, `attempt`), as plain JSON."""
        require([h.rank for h in handles] == ranks,
                f"submit returned ranks {[h.rank for h in handles]}; it returns one handle per rank in "
                f"request.ranks order, {ranks}", "#submitting")
        for h in handles:
            where = f"rank {h.rank}'s handle metadata {dict(h.metadata)!r}"
            require(h.run_id == run_id, f"{where} has no `run_id` {run_id!r}", "#handles")
            require("attempt" in h.metadata and h.attempt == attempt,
                    f"{where} has no `attempt` {attempt}: core numbers relaunches and `diloco logs --attempt` "
                    f"from it", "#handles")
            require(ReplicaHandle.from_json(h.to_json()) == h, f"{where} is not plain JSON", "#handles")

    # the contract -------------------------------------------------------------------------

    def test_satisfies_protocol(self):
        executor = self.make_executor()
        cls = type(executor)
        require(isinstance(executor, Executor), f"{cls.__name__} lacks one of the methods plan, submit, poll, "
                f"stream_logs, cancel, collect, or `backend_name`/`capabilities`/`Options`", "#the-contract")
        require(isinstance(getattr(cls, "backend_name", None), str) and cls.backend_name,
                "declare `backend_name = \"...\"` on the class: a spec's `backend =` selects it by that", "#the-contract")
        require(isinstance(getattr(cls, "capabilities", None), Capabilities)
                and isinstance(executor.capabilities, Capabilities),
                "declare `capabilities = Capabilities(...)` on the class: `diloco backends` and the estimate read "
                "it without building an executor", "#capabilities")
        require(dataclasses.is_dataclass(getattr(cls, "Options", None)),
                "declare the [backend] options as `Options`, a frozen dataclass", "#options")

    def test_every_option_is_documented(self):
        """`diloco backends NAME` shows each [backend] option's help (`option(help=...)`): an option
        without one leaves its users guessing."""
        missing = [o.name for o in backend_options(type(self.make_executor())) if not o.help]
        require(not missing, f"options without help: {missing}; give each `option(help=...)`", "#options")

    def test_every_number_option_is_bounded(self):
        """A spec is untrusted input: a number with no upper bound (10**23 seconds, GB, retries)
        passes the dry run and fails at the platform, late and in its own words."""
        options = backend_options(type(self.make_executor()))
        unbounded = [o.name for o in options if ("int" in o.type.split(" | ") or "float" in o.type.split(" | "))
                     and (o.min is None or o.max is None)]
        require(not unbounded, f"number options without both bounds: {unbounded}; declare `option(..., min=, max=)`",
                "#options")

    def test_capabilities_hold(self):
        """What `capabilities` declares is what core relies on: a preemption signal the runner can
        install, a cloud the estimate prices, the methods `status_detail`, `numbered_reruns` and
        `log_files` promise (a replica that has run once has been re-run 0 times, or cannot tell)."""
        executor = self.executor()
        caps = executor.capabilities
        require(caps.preemption_signal is None or caps.preemption_signal in signal.Signals.__members__,
                f"preemption_signal {caps.preemption_signal!r} is not a signal name such as 'SIGINT'", "#capabilities")
        require(caps.cloud is None or caps.cloud in CLOUDS, f"cloud {caps.cloud!r} is not one of {CLOUDS} or None",
                "#capabilities")
        for flag, (declared, method) in OPTIONAL_METHODS.items():
            require(not getattr(caps, flag) or isinstance(executor, declared),
                    f"capabilities.{flag} is true but the executor has no `{method}(handle)` "
                    f"(diloco.protocol.{declared.__name__})", "#capabilities")
        if caps.status_detail or caps.numbered_reruns:
            handles = self.launch(executor, REPORT, n=1)
            detail = executor.status_detail(handles[0]) if caps.status_detail else None
            executor.collect(handles, timeout=self.wait_timeout)
            require(detail is None or isinstance(detail, str),
                    f"status_detail returned {type(detail).__name__}, not str or None", "#capabilities")
            reruns = executor.reruns(handles[0]) if caps.numbered_reruns else None
            require(reruns in (None, 0) and not isinstance(reruns, bool),
                    f"reruns returned {reruns!r} for a replica that ran once: 0 (or None: cannot tell)",
                    "#capabilities")

    def test_log_path_is_a_local_file_the_output_grows_in(self):
        """`diloco logs --follow` tails `log_path(handle)` from another process when `log_files` is declared."""
        executor = self.executor()
        if not executor.capabilities.log_files:
            return
        handles = self.launch(executor, REPORT, {"marker": "tailed-by-follow"}, n=1)
        path = self.executor().log_path(handles[0])  # another instance: `diloco logs` runs in another shell
        require(isinstance(path, Path), f"log_path returned {type(path).__name__} {path!r}; capabilities.log_files "
                                        f"needs a pathlib.Path", "#capabilities")
        require(path.is_absolute(), f"log_path returned {path}, relative to where the executor ran", "#capabilities")
        executor.collect(handles, timeout=self.wait_timeout)
        require(path.is_file() and "tailed-by-follow" in path.read_text(errors="replace"),
                f"log_path {path} does not hold the replica's output", "#capabilities")

    def test_handles_in_rank_order_and_results_shape(self):
        executor = self.executor()
        run_id = self.run_id()
        handles = self.launch(executor, REPORT, run_id=run_id)
        self.check_handles(handles, run_id, list(range(self.n_replicas)), 0)
        require(all(h.backend_name == executor.backend_name for h in handles),
                "a handle's backend_name is not the executor's", "#handles")
        results = executor.collect(handles, timeout=self.wait_timeout)
        require([r.rank for r in results] == list(range(self.n_replicas)),
                f"collect returned ranks {[r.rank for r in results]}, not one result per handle in order", "#the-contract")
        for r in results:
            require(isinstance(r.status, ReplicaStatus), f"collect gave rank {r.rank} the status {r.status!r}, "
                                                         f"not a ReplicaStatus", "#the-contract")
            require(r.status == ReplicaStatus.SUCCEEDED and r.exit_code == 0 and r.error is None,
                    f"rank {r.rank} of an entrypoint that returns reads {r.status} exit {r.exit_code}: {r.error}",
                    "#variables-and-the-result-file")
            require(r.result is None or (r.result["rank"] == r.rank and r.result["world_size"] == self.n_replicas),
                    f"rank {r.rank}'s result {r.result!r} is not its entrypoint's return value",
                    "#variables-and-the-result-file")

    def test_failed_rank_reports_its_error(self):
        executor = self.executor()
        handles = self.launch(executor, FAIL_ON, {"fail_rank": 1})
        results = executor.collect(handles, timeout=self.wait_timeout)
        statuses = [str(r.status) for r in results]
        require(statuses == ["succeeded", "failed", "succeeded"][: self.n_replicas],
                f"ranks read {statuses} where only rank 1 raised", "#the-contract")
        require(results[1].exit_code not in (0, None), f"a failed rank's exit code is {results[1].exit_code}",
                "#the-contract")
        require("deliberate failure on rank 1" in (results[1].error or executor.stream_logs(handles[1])),
                f"neither the failed rank's error {results[1].error!r} nor its logs say why it failed", "#the-contract")

    def test_statuses_are_protocol_values(self):
        executor = self.executor()
        handles = self.launch(executor, REPORT, n=1)
        first = executor.poll(handles[0])  # checked before collect, which polls too
        require(isinstance(first, ReplicaStatus), f"poll returned {first!r}; it returns a ReplicaStatus", "#the-contract")
        executor.collect(handles, timeout=self.wait_timeout)
        last = executor.poll(handles[0])
        require(last is ReplicaStatus.SUCCEEDED, f"poll returned {last!r} after the replica succeeded", "#the-contract")

    def test_logs_hold_replica_output(self):
        executor = self.executor()
        handles = self.launch(executor, REPORT, {"marker": "hello-from-conformance"}, n=2)
        executor.collect(handles, timeout=self.wait_timeout)
        text = executor.stream_logs(handles[1], n_lines=50)
        require(isinstance(text, str) and "hello-from-conformance" in text and "rank=1" in text,
                f"stream_logs of rank 1 does not hold what it printed: {text!r}", "#the-contract")

    def test_cancel_is_idempotent(self):
        executor = self.executor()
        handles = self.launch(executor, SLEEP, {"seconds": 120}, n=2)
        require(self.wait_until(executor, handles[0], {"running"}) == "running",
                "a sleeping replica never read running", "#the-contract")
        executor.cancel(handles[0])
        executor.cancel(handles[0])  # again: no error
        require(self.wait_until(executor, handles[0], {"cancelled"}) == "cancelled",
                "a cancelled replica does not read cancelled; the runner writes no result on SIGTERM, so the "
                "backend remembers that it cancelled", "#variables-and-the-result-file")
        for h in handles:
            executor.cancel(h)
        done = self.launch(executor, REPORT, n=1)
        executor.collect(done, timeout=self.wait_timeout)
        executor.cancel(done[0])  # already ended: still no error, status kept
        require(executor.poll(done[0]) == "succeeded", "cancelling a replica that had succeeded changed its status",
                "#the-contract")

    def test_durable_handle_round_trip(self):
        first = self.executor()
        handles = self.launch(first, SLEEP, {"seconds": 120}, n=1)
        text = handles[0].to_json()
        json.loads(text)  # plain JSON, no pickle
        again = ReplicaHandle.from_json(text)
        require(again == handles[0], "a handle does not survive to_json/from_json", "#handles")
        other = self.executor()  # stands for another process
        require(self.wait_until(other, again, {"running"}) == "running",
                "another executor instance cannot poll a handle from its JSON", "#handles")
        require(isinstance(other.stream_logs(again, n_lines=10), str),
                "another executor instance cannot read a handle's logs", "#handles")
        other.cancel(again)
        require(self.wait_until(first, handles[0], {"cancelled"}) == "cancelled",
                "another executor instance cannot cancel a handle from its JSON", "#handles")
        require(SECRET_VALUE not in text, "a handle holds a secret value", "#handles")

    def test_relaunch_one_rank_as_new_attempt(self):
        executor = self.executor()
        if not executor.capabilities.relaunches_one_rank:
            return
        run_id = self.run_id()
        handles = self.launch(executor, REPORT, run_id=run_id, ranks=[1], attempt=1)
        self.check_handles(handles, run_id, [1], 1)
        (result,) = executor.collect(handles, timeout=self.wait_timeout)
        require(result.status == "succeeded" and result.attempt == 1,
                f"rank 1 relaunched as attempt 1 reads {result.status}, attempt {result.attempt}", "#handles")
        require(result.result is None or (result.result["rank"] == 1 and result.result["attempt"] == 1),
                f"rank 1 attempt 1 ran as {result.result!r}: plan the request's ranks and attempt", "#submitting")

    def test_plan_shows_request_without_secrets(self):
        executor = self.executor()
        plan = plan_for(executor, self.n_replicas, REPORT, {"lr": 0.1}, run_id=self.run_id(),
                        env={"AWS_SECRET_ACCESS_KEY": SECRET_VALUE, "PLAIN": "visible-value"},
                        secret_env={"HF_TOKEN": SECRET_VALUE})
        rendered = plan.render("json")
        require(plan.backend_name == executor.backend_name, "the plan's backend_name is not the executor's",
                "#the-contract")
        require(SECRET_VALUE not in rendered and SECRET_VALUE not in repr(plan),
                "the plan shows a secret value; put request.secrets.redacted() where secrets go", "#the-contract")
        require("visible-value" in rendered, "the plan hides the request's plain environment", "#the-contract")
        require(set(plan.request.secrets) == {"AWS_SECRET_ACCESS_KEY", "HF_TOKEN"},
                "the plan's request lost its secrets", "#the-contract")

    def test_plan_is_a_pure_function_of_the_request(self):
        """A dry run and the run plan the same request the same way (nothing random, nothing
        read from the clock), so what `diloco dryrun` prints is what `diloco run` submits."""
        executor = self.executor()
        run_id = self.run_id()
        first = plan_for(executor, self.n_replicas, REPORT, {"lr": 0.1}, run_id=run_id, env={"PLAIN": "x"})
        again = plan_for(self.executor(), self.n_replicas, REPORT, {"lr": 0.1}, run_id=run_id, env={"PLAIN": "x"})
        require(first.render("json") == again.render("json"),
                "planning the same request twice gave two plans (a clock, a random name)", "#the-contract")
