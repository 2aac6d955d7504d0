"""A test double for the parts of Modal that need Modal's cloud, shaped exactly like modal's API.

Modal's control plane cannot run here, so `FakeModal.install()` replaces, on the real `modal`
module, only the calls that would reach it; everything else is real modal (apps, functions,
images, secrets and volumes are defined by modal itself, without a token):

- `modal.App.lookup`, `App.deploy`, `Function.from_name`, `Function.spawn`, `FunctionCall.from_id`;
- `modal.Sandbox.create` / `from_id`, `Secret.from_dict` / `from_name`, `Volume.from_name`;
- the objects they return have modal's shapes: `object_id`, `poll()`, `returncode`, `wait()`,
  `terminate()`, `get_tags()` / `set_tags()`, `logs.tail(n)` yielding real `modal.types.LogEntry`;
  `FunctionCall.get_call_graph()` yielding real `modal.types.InputInfo`, `cancel()`, `logs`.

Each sandbox or function call is a *container*: a detached local process
(`python -m diloco_modal.testing.container DIR`) that runs the command (or the function's
body, `diloco_modal.testing.call`) with only what a Modal container would see — the image's
basics (PATH, HOME, locale), the sandbox's `env`, its secrets — never the test's own AWS_* or
DILOCO_* variables. It records output and exit status in files under the double's root, so
any process (a second shell, a resumed launcher) sees the same cloud. As on Modal:
`terminate()` kills the container (exit 137), the sandbox timeout kills it (exit 124), a
preemption (`FakeModal.preempt`) sends SIGINT, Modal's preemption notice, and kills what is
left after a grace period; a preempted function call is restarted on the same input.

What the double cannot be: images are not built. The container runs this machine's Python, and
paths the image would hold (the workdir shipped to `/root/diloco-workdir`, your function's
module) are mapped to local directories given as `image_paths` / `pythonpath`.

In a subprocess, `python -m diloco_modal.testing <diloco args>` is the diloco CLI with the double
installed; it reads the double's root from DILOCO_FAKE_MODAL.

Here: `FakeModal` (the cloud, and `install()`); in `files` its state on disk, in `objects` the
objects it hands out, in `container` and `call` what runs inside a container.
"""

from __future__ import annotations

import json
import os
import secrets as _secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .files import GRACE_SECONDS, ROOT_ENV, _check_token, _modal, _node_env, _read_json, _write_json
from .objects import FakeFunctionCall, FakeSandbox, FakeSecret, FakeVolume, _Container, _DeployedFunction

__all__ = ["ROOT_ENV", "FakeFunctionCall", "FakeModal", "FakeSandbox", "FakeSecret", "FakeVolume"]


class FakeModal:
    """The double's cloud: a root directory any process can open (see the module docstring)."""

    def __init__(self, root: str | Path, *, image_paths: dict[str, str] | None = None,
                 pythonpath: list[str] | None = None, grace_seconds: float = GRACE_SECONDS):
        self.root = Path(root)
        (self.root / "objects").mkdir(parents=True, exist_ok=True)
        config = self.root / "config.json"
        if image_paths is not None or pythonpath is not None or not config.exists():
            _write_json(config, {"image_paths": dict(image_paths or {}), "pythonpath": list(pythonpath or []),
                                 "grace_seconds": grace_seconds})
        self.config = _read_json(config, {})
        self._saved: list[tuple[Any, str, Any]] = []

    @classmethod
    def from_env(cls) -> FakeModal:
        return cls(os.environ[ROOT_ENV])

    # -- the cloud's state -----------------------------------------------------------------------

    def add_secret(self, name: str, values: dict[str, str]) -> None:
        """A named secret, as `modal secret create NAME K=V` would make it."""
        data = _read_json(self.root / "secrets.json", {})
        data[name] = dict(values)
        _write_json(self.root / "secrets.json", data)

    def objects(self, prefix: str = "") -> list[str]:
        return sorted(p.name for p in (self.root / "objects").iterdir() if p.name.startswith(prefix))

    def live_processes(self) -> list[int]:
        """Pids of every process still running in any container (for 'nothing left running' checks)."""
        pids = []
        for oid in self.objects():
            pgid = _read_json(self.root / "objects" / oid / "container.json", {}).get("pid")
            if pgid:
                for proc in Path("/proc").iterdir():
                    if proc.name.isdigit():
                        try:
                            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
                        except OSError:
                            continue
                        if int(stat[2]) == pgid and stat[0] not in ("Z", "X"):
                            pids.append(int(proc.name))
        return pids

    def kill(self, object_id: str, sig: int = signal.SIGKILL) -> bool:
        """Send `sig` to the container's workload (a crashed or OOM-killed replica)."""
        pid = _read_json(self.root / "objects" / object_id / "container.json", {}).get("workload_pid")
        if not pid or _read_json(self.root / "objects" / object_id / "exit.json"):
            return False
        os.kill(pid, sig)
        return True

    def preempt(self, object_id: str) -> bool:
        """What Modal does to a preempted container: SIGINT to its workload, a grace period, then the
        kill; a function call's input is then restarted in a new container."""
        obj = self.root / "objects" / object_id
        (obj / "preempting").write_text(str(time.time()))
        return self.kill(object_id, signal.SIGINT)

    # -- the client side ---------------------------------------------------------------------------

    def _start(self, kind: str, spec: dict[str, Any]) -> str:
        _check_token()
        oid = f"{kind}-{_secrets.token_hex(8)}"
        obj = self.root / "objects" / oid
        obj.mkdir(parents=True)
        _write_json(obj / "spec.json", spec)
        _write_json(obj / "tags.json", dict(spec.get("tags") or {}))
        proc = subprocess.Popen([sys.executable, "-m", "diloco_modal.testing.container", str(obj)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True, env={**_node_env(), ROOT_ENV: str(self.root),
                                                             "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
        _write_json(obj / "container.json", {"pid": proc.pid})  # its process group, from the first moment
        return oid

    def _secret_env(self, secrets: list[Any]) -> dict[str, str]:
        named = _read_json(self.root / "secrets.json", {})
        out: dict[str, str] = {}
        for s in secrets or []:
            if s.name is not None:
                if s.name not in named:
                    raise _modal().exception.NotFoundError(f"Secret '{s.name}' not found in environment 'main'")
                out.update(named[s.name])
            else:
                out.update(s.values)
        return out

    def fail_creates_after(self, n: int, message: str = "ResourceExhausted: no GPU capacity in region") -> None:
        """The next sandbox creations succeed `n` times, then fail (a quota or capacity error)."""
        _write_json(self.root / "fail-creates.json", {"left": n, "message": message})

    def _injected_create_failure(self) -> None:
        plan = _read_json(self.root / "fail-creates.json")
        if plan is None:
            return
        if plan["left"] <= 0:
            raise _modal().exception.ResourceExhaustedError(plan["message"])
        _write_json(self.root / "fail-creates.json", {**plan, "left": plan["left"] - 1})

    def sandbox_create(self, *args: str, app: Any = None, name: str | None = None, tags: dict | None = None,
                       image: Any = None, env: dict | None = None, secrets: list | None = None,
                       volumes: dict | None = None, timeout: int | None = 300, workdir: str | None = None,
                       gpu: str | None = None, **kwargs: Any) -> FakeSandbox:
        if app is None:
            raise _modal().exception.InvalidError("App is required when creating a Sandbox outside a container")
        _check_token()
        self._injected_create_failure()
        for path, vol in (volumes or {}).items():
            if isinstance(vol, FakeVolume) and vol.name not in self.volumes():
                raise _modal().exception.NotFoundError(f"Volume '{vol.name}' not found")
        spec = {"kind": "sandbox", "command": list(args), "name": name, "tags": dict(tags or {}),
                "env": {**{k: v for k, v in (env or {}).items() if v is not None}, **self._secret_env(secrets or [])},
                "timeout": timeout, "workdir": workdir, "gpu": gpu, "app": getattr(app, "name", None)}
        return FakeSandbox(self, self._start("sb", spec))

    def spawn(self, function: Any, *args: Any, **kwargs: Any) -> FakeFunctionCall:
        from modal._utils.async_utils import synchronizer

        impl = synchronizer._translate_in(function)
        app_name = impl._app.name if getattr(impl, "_app", None) else None
        return self.spawn_deployed(app_name, impl._tag, *args, **kwargs)

    def spawn_deployed(self, app_name: str | None, tag: str, *args: Any, **kwargs: Any) -> FakeFunctionCall:
        _check_token()
        fn = (_read_json(self.root / "deployed.json", {}).get(app_name) or {}).get(tag)
        if fn is None:
            raise _modal().exception.ExecutionError(
                "Function has not been hydrated with the metadata it needs to run on Modal, because the App it is "
                "defined on is not running.")
        json.dumps(kwargs)  # the double carries inputs as JSON (Modal would pickle them)
        spec = {"kind": "function", "module": fn["module"], "qualname": fn["qualname"], "function_name": tag,
                "args": list(args), "kwargs": kwargs, "env": self._secret_env(
                    [FakeSecret(s["values"], s["name"]) for s in fn["secrets"]])}
        return FakeFunctionCall(self, self._start("fc", spec))

    def deploy(self, app: Any, **kwargs: Any) -> Any:
        """`modal deploy`: the app's functions become spawnable, with the secrets they were declared with."""
        _check_token()
        from modal._utils.async_utils import synchronizer

        impl = synchronizer._translate_in(app)
        functions = {}
        for tag, fn in impl._local_state.functions.items():
            raw = fn._raw_f
            secrets = [s for s in (getattr(fn._spec, "secrets", None) or []) if isinstance(s, FakeSecret)]
            functions[tag] = {"module": raw.__module__, "qualname": raw.__qualname__,
                              "secrets": [{"name": s.name, "values": s.values} for s in secrets]}
        data = _read_json(self.root / "deployed.json", {})
        data[impl.name] = functions
        _write_json(self.root / "deployed.json", data)
        return app

    def volumes(self) -> set[str]:
        return set(_read_json(self.root / "volumes.json", []))

    def add_volume(self, name: str) -> None:
        _write_json(self.root / "volumes.json", sorted(self.volumes() | {name}))

    # -- installing it ---------------------------------------------------------------------------

    def install(self) -> FakeModal:
        """Replace the cloud-touching calls of the real modal module with this double's."""
        modal = _modal()
        fake = self

        class _App:
            @staticmethod
            def lookup(name: str, *, create_if_missing: bool = False, environment_name: str | None = None, **_: Any):
                _check_token()
                return modal.App(name)

        def from_name_function(app_name: str, name: str, *, environment_name: str | None = None, **_: Any):
            _check_token()
            deployed = _read_json(fake.root / "deployed.json", {})
            if name not in (deployed.get(app_name) or {}):
                raise modal.exception.NotFoundError(f"Lookup failed for Function '{name}' from the '{app_name}' app")
            return _DeployedFunction(fake, app_name, name)

        patches = [
            (modal.App, "lookup", staticmethod(_App.lookup)),
            (modal.App, "deploy", lambda app, **kw: fake.deploy(app, **kw)),
            (modal.Function, "spawn", lambda fn, *a, **kw: fake.spawn(fn, *a, **kw)),
            (modal.Function, "from_name", staticmethod(from_name_function)),
            (modal.FunctionCall, "from_id", staticmethod(lambda oid, client=None: FakeFunctionCall(fake, oid))),
            (modal.Sandbox, "create", staticmethod(fake.sandbox_create)),
            (modal.Sandbox, "from_id", staticmethod(lambda oid, client=None: FakeSandbox(fake, oid))),
            (modal.Secret, "from_dict", staticmethod(lambda env_dict={}, **_: FakeSecret(
                {k: v for k, v in env_dict.items() if v is not None}))),
            (modal.Secret, "from_name", staticmethod(lambda name, **_: FakeSecret(name=name))),
            (modal.Volume, "from_name", staticmethod(lambda name, **_: FakeVolume(name))),
        ]
        for owner, attr, value in patches:
            self._saved.append((owner, attr, owner.__dict__.get(attr)))
            setattr(owner, attr, value)
        return self

    def uninstall(self) -> None:
        for owner, attr, value in reversed(self._saved):
            setattr(owner, attr, value)
        self._saved.clear()

    def __enter__(self) -> FakeModal:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        for oid in self.objects():
            obj = self.root / "objects" / oid
            if not (obj / "exit.json").exists():
                _Container(self, oid)._kill("terminated", 137)
        self.uninstall()
