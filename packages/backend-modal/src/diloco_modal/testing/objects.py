"""The objects the Modal double hands out, shaped like modal's: sandboxes, function calls and
their logs, secrets, volumes and deployed functions. Each sandbox or call is a directory under
the double's root (see `diloco_modal.testing`), so any process sees the same one.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from .files import _modal, _read_json, _write_json, write_exit

if TYPE_CHECKING:
    from . import FakeModal


class _Logs:
    """`obj.logs`: `tail(n)` yields `modal.types.LogEntry`, one per output line."""

    def __init__(self, obj: _Container):
        self._obj = obj

    def tail(self, entries: int = 100, *, source: str | None = None):
        from modal.types import LogEntry

        try:
            lines = (self._obj.dir / "output.log").read_text(errors="replace").splitlines(keepends=True)
        except FileNotFoundError:
            lines = []
        now = datetime.now(timezone.utc)
        for line in lines[-entries:]:
            yield LogEntry(message=line, timestamp=now, source="stdout", object_id=self._obj.object_id,
                           context_ids=[self._obj.object_id])


class _Container:
    """What sandboxes and function calls share: a directory and a detached container process."""

    def __init__(self, fake: FakeModal, object_id: str):
        self.fake, self.object_id = fake, object_id
        self.dir = fake.root / "objects" / object_id
        if not (self.dir / "spec.json").exists():
            raise _modal().exception.NotFoundError(f"No object with id {object_id!r} exists")

    @property
    def spec(self) -> dict[str, Any]:
        return _read_json(self.dir / "spec.json", {})

    def _exit(self) -> dict[str, Any] | None:
        return _read_json(self.dir / "exit.json")

    @property
    def logs(self) -> _Logs:
        return _Logs(self)

    def _kill(self, status: str, exitcode: int) -> None:
        write_exit(self.dir, status, exitcode)
        pid = _read_json(self.dir / "container.json", {}).get("pid")
        if pid:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def get_dashboard_url(self) -> str:
        return f"https://modal.com/id/{self.object_id}"


class FakeSandbox(_Container):
    """Shaped like `modal.Sandbox`."""

    def poll(self) -> int | None:
        ended = self._exit()
        return None if ended is None else int(ended["exitcode"])

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def wait(self, raise_on_termination: bool = True) -> None:
        while self.poll() is None:
            time.sleep(0.05)
        ended = self._exit() or {}
        if ended.get("status") == "timeout":
            raise _modal().exception.SandboxTimeoutError()
        if ended.get("status") == "terminated" and raise_on_termination:
            raise _modal().exception.SandboxTerminatedError()

    def terminate(self, *, wait: bool = False) -> int | None:
        if self.poll() is None:
            self._kill("terminated", 137)
        return self.poll() if wait else None

    def get_tags(self) -> dict[str, str]:
        return dict(_read_json(self.dir / "tags.json", {}))

    def set_tags(self, tags: dict[str, str], *, client: Any = None) -> None:
        _write_json(self.dir / "tags.json", dict(tags))


class FakeFunctionCall(_Container):
    """Shaped like `modal.FunctionCall` (no `get`: diloco never unpickles a call's output)."""

    def get_call_graph(self) -> list[Any]:
        from modal.types import InputInfo, InputStatus

        ended = self._exit()
        task = _read_json(self.dir / "container.json", {}).get("task_id", "")
        status = InputStatus.PENDING if ended is None else {
            "success": InputStatus.SUCCESS, "failure": InputStatus.FAILURE, "terminated": InputStatus.TERMINATED,
            "timeout": InputStatus.TIMEOUT}[ended["status"]]
        spec = self.spec
        return [InputInfo(input_id=f"in-{self.object_id[3:]}", function_call_id=self.object_id, task_id=task,
                          status=status, function_name=spec.get("function_name", ""),
                          module_name=spec.get("module", ""), children=[])]

    def cancel(self, terminate_containers: bool = False) -> None:
        if self._exit() is None:
            self._kill("terminated", 137)


class FakeSecret:
    """Stands for a `modal.Secret` whose values the double must know to inject them."""

    def __init__(self, values: dict[str, str] | None = None, name: str | None = None):
        self.values, self.name = dict(values or {}), name



class FakeVolume:
    def __init__(self, name: str):
        self.name = name


class _DeployedFunction:
    """What `modal.Function.from_name` returns for a deployed function: spawnable by name."""

    def __init__(self, fake: FakeModal, app_name: str, name: str):
        self.fake, self.app_name, self.name = fake, app_name, name

    def spawn(self, *args: Any, **kwargs: Any) -> FakeFunctionCall:
        return self.fake.spawn_deployed(self.app_name, self.name, *args, **kwargs)

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        raise _modal().exception.InvalidError("the double runs functions with spawn only")

