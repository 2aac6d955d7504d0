"""Conformance kit: the protocol's contract as tests any backend package can run.

A backend proves it honours the executor contract by subclassing `ExecutorConformance` in its
own test suite and saying how to build an executor::

    from diloco.testing import ExecutorConformance

    class TestFooConformance(ExecutorConformance):
        def make_executor(self):
            return FooExecutor(namespace="test")

`make_executor` is called more than once per test: a second instance stands for another
process, so durable handles are checked for real. It may return an executor of either contract:
the current one (`plan` / `submit`, `Options`, `capabilities`) or the first one (`launch_replicas`
/ `dryrun`, options as `__init__` keywords), which the kit runs through `diloco.legacy`, as
`diloco run` does. Override `wait_timeout` for slow backends, and `setup_method`/fixtures for
whatever stand-ins the backend's tests need (a Kubernetes API emulator, an S3 server).

`launch` and `plan_for` are also the shortest way to start replicas from a backend's own tests.
"""

from __future__ import annotations

import abc
import json
import time
import uuid
from typing import Any

from diloco.legacy import as_executor, capabilities_of, describe_backend_options, is_first_contract
from diloco.protocol import Capabilities, Executor, ReplicaHandle, ReplicaStatus
from diloco.request import LaunchPlan, LaunchRequest, Secrets

REPORT = "diloco.testing.entrypoints:report"
FAIL_ON = "diloco.testing.entrypoints:fail_on"
SLEEP = "diloco.testing.entrypoints:sleep"
SECRET_VALUE = "conformance-secret-value-7f3a"


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
    """What `diloco dryrun` would print for such a launch on `executor` (either contract)."""
    return as_executor(executor).plan(request_for(n_replicas, entrypoint, args, **fields))


def launch(executor: Any, n_replicas: int, entrypoint: Any, args: dict[str, Any] | None = None,
           **fields: Any) -> list[ReplicaHandle]:
    """Plan and submit, as `diloco run` does; the handles in rank order."""
    executor = as_executor(executor)
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
        """`make_executor()` as the current contract sees it."""
        return as_executor(self.make_executor())

    def launch(self, executor: Executor, entrypoint: str, args: dict[str, Any] | None = None,
               **kwargs: Any) -> list[ReplicaHandle]:
        kwargs.setdefault("run_id", self.run_id())
        kwargs.setdefault("timeout", 120)
        return launch(executor, kwargs.pop("n", self.n_replicas), entrypoint, args, **kwargs)

    def wait_until(self, executor: Executor, handle: ReplicaHandle, wanted: set[str]) -> str:
        return wait_for_status(executor, handle, wanted, timeout=self.wait_timeout)

    # the contract -------------------------------------------------------------------------

    def test_satisfies_protocol(self):
        raw = self.make_executor()
        executor = as_executor(raw)
        assert isinstance(executor, Executor)
        assert isinstance(executor.backend_name, str) and executor.backend_name
        assert isinstance(capabilities_of(executor), Capabilities)
        if not is_first_contract(type(raw)):  # the current contract declares; nothing is sniffed
            assert isinstance(type(raw).__dict__.get("capabilities", raw.capabilities), Capabilities)
            assert getattr(type(raw), "Options", None) is not None, "declare the [backend] options as `Options`"

    def test_every_option_is_documented(self):
        """`diloco backends NAME` shows each [backend] option's help (`option(help=...)`, or a
        first-contract executor's `Args:` docstring): an option without one leaves its users guessing."""
        missing = [o.name for o in describe_backend_options(type(self.make_executor())) if not o.help]
        assert not missing, f"options without help: {missing}"

    def test_every_number_option_is_bounded(self):
        """A spec is untrusted input: a number with no upper bound (10**23 seconds, GB, retries)
        passes the dry run and fails at the platform, late and in its own words."""
        executor = self.make_executor()
        if is_first_contract(type(executor)):
            import pytest

            pytest.skip("first-contract executors declare no bounds (keyword options); `Options` can")
        options = describe_backend_options(type(executor))
        unbounded = [o.name for o in options if ("int" in o.type.split(" | ") or "float" in o.type.split(" | "))
                     and (o.min is None or o.max is None)]
        assert not unbounded, f"declare min= and max= on the number options {unbounded} (diloco.options.option)"

    def test_handles_in_rank_order_and_results_shape(self):
        executor = self.executor()
        handles = self.launch(executor, REPORT)
        assert [h.rank for h in handles] == list(range(self.n_replicas))
        assert all(h.backend_name == executor.backend_name for h in handles)
        results = executor.collect(handles, timeout=self.wait_timeout)
        assert [r.rank for r in results] == list(range(self.n_replicas))
        for r in results:
            assert r.status == ReplicaStatus.SUCCEEDED == "succeeded", r.error
            assert r.exit_code == 0 and r.error is None
            if r.result is not None:  # backends that can carry return values must carry the right ones
                assert r.result["rank"] == r.rank and r.result["world_size"] == self.n_replicas

    def test_failed_rank_reports_its_error(self):
        executor = self.executor()
        handles = self.launch(executor, FAIL_ON, {"fail_rank": 1})
        results = executor.collect(handles, timeout=self.wait_timeout)
        assert [r.status for r in results] == ["succeeded", "failed", "succeeded"][: self.n_replicas]
        assert results[1].exit_code not in (0, None)
        assert "deliberate failure on rank 1" in (results[1].error or executor.stream_logs(handles[1]))

    def test_statuses_are_protocol_values(self):
        executor = self.executor()
        handles = self.launch(executor, REPORT, n=1)
        seen = {executor.poll(handles[0])}
        executor.collect(handles, timeout=self.wait_timeout)
        seen.add(executor.poll(handles[0]))
        assert seen <= set(ReplicaStatus) and ReplicaStatus.SUCCEEDED in seen

    def test_logs_hold_replica_output(self):
        executor = self.executor()
        handles = self.launch(executor, REPORT, {"marker": "hello-from-conformance"}, n=2)
        executor.collect(handles, timeout=self.wait_timeout)
        text = executor.stream_logs(handles[1], n_lines=50)
        assert "hello-from-conformance" in text and "rank=1" in text

    def test_cancel_is_idempotent(self):
        executor = self.executor()
        handles = self.launch(executor, SLEEP, {"seconds": 120}, n=2)
        assert self.wait_until(executor, handles[0], {"running"}) == "running"
        executor.cancel(handles[0])
        executor.cancel(handles[0])  # again: no error
        assert self.wait_until(executor, handles[0], {"cancelled"}) == "cancelled"
        for h in handles:
            executor.cancel(h)
        done = self.launch(executor, REPORT, n=1)
        executor.collect(done, timeout=self.wait_timeout)
        executor.cancel(done[0])  # already ended: still no error, status kept
        assert executor.poll(done[0]) == "succeeded"

    def test_durable_handle_round_trip(self):
        first = self.executor()
        handles = self.launch(first, SLEEP, {"seconds": 120}, n=1)
        text = handles[0].to_json()
        json.loads(text)  # plain JSON, no pickle
        again = ReplicaHandle.from_json(text)
        assert again == handles[0]
        other = self.executor()  # stands for another process
        assert self.wait_until(other, again, {"running"}) == "running"
        assert isinstance(other.stream_logs(again, n_lines=10), str)
        other.cancel(again)
        assert self.wait_until(first, handles[0], {"cancelled"}) == "cancelled"
        assert SECRET_VALUE not in text

    def test_relaunch_one_rank_as_new_attempt(self):
        executor = self.executor()
        if not capabilities_of(executor).relaunches_one_rank:
            return
        run_id = self.run_id()
        handles = self.launch(executor, REPORT, run_id=run_id, ranks=[1], attempt=1)
        assert [(h.rank, h.attempt) for h in handles] == [(1, 1)]
        (result,) = executor.collect(handles, timeout=self.wait_timeout)
        assert result.status == "succeeded" and result.attempt == 1
        if result.result is not None:
            assert result.result["rank"] == 1 and result.result["attempt"] == 1

    def test_plan_shows_request_without_secrets(self):
        executor = self.executor()
        plan = plan_for(executor, self.n_replicas, REPORT, {"lr": 0.1}, run_id=self.run_id(),
                        env={"AWS_SECRET_ACCESS_KEY": SECRET_VALUE, "PLAIN": "visible-value"},
                        secret_env={"HF_TOKEN": SECRET_VALUE})
        rendered = plan.render("json")
        assert plan.backend_name == executor.backend_name
        assert SECRET_VALUE not in rendered and SECRET_VALUE not in repr(plan)
        assert "visible-value" in rendered
        assert set(plan.request.secrets) == {"AWS_SECRET_ACCESS_KEY", "HF_TOKEN"}

    def test_plan_is_a_pure_function_of_the_request(self):
        """A dry run and the run plan the same request the same way (nothing random, nothing
        read from the clock), so what `diloco dryrun` prints is what `diloco run` submits."""
        executor = self.executor()
        run_id = self.run_id()
        first = plan_for(executor, self.n_replicas, REPORT, {"lr": 0.1}, run_id=run_id, env={"PLAIN": "x"})
        again = plan_for(self.executor(), self.n_replicas, REPORT, {"lr": 0.1}, run_id=run_id, env={"PLAIN": "x"})
        assert first.render("json") == again.render("json")
