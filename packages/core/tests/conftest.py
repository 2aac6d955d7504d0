"""Fixtures for diloco-core's tests: an isolated state dir and a way to run the real CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from diloco.plugins import discovery as plugins


@pytest.fixture(autouse=True)
def state_dir(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "state"
    monkeypatch.setenv("DILOCO_STATE_DIR", str(d))
    plugins.reset()
    yield d
    plugins.reset()


@pytest.fixture
def cli(state_dir):
    """Run `python -m diloco ARGS` as a separate process (a second shell, as a user would)."""

    def run(*args: str, env: dict[str, str] | None = None, timeout: float = 120, cwd=None,
            check_rc: int | None = None) -> subprocess.CompletedProcess:
        full_env = {**os.environ, "DILOCO_STATE_DIR": str(state_dir), **(env or {})}
        if env and "PYTHONPATH" in env and os.environ.get("PYTHONPATH"):  # a plugin's site, plus the caller's
            full_env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], os.environ["PYTHONPATH"]])  # tree under test
        proc = subprocess.run([sys.executable, "-m", "diloco", *args], capture_output=True, text=True,
                              env=full_env, timeout=timeout, cwd=cwd)
        if check_rc is not None:
            assert proc.returncode == check_rc, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        return proc

    return run


@pytest.fixture
def project(tmp_path) -> Path:
    """A directory with a small training-like module and a spec that runs it."""
    d = tmp_path / "proj"
    d.mkdir()
    (d / "job.py").write_text(
        "import os, time\n"
        "def main(ctx, steps: int = 3, fail_rank: int = -1, delay: float = 0.05):\n"
        "    for i in range(steps):\n"
        "        print(f'rank {ctx.rank}/{ctx.world_size} step {i}', flush=True)\n"
        "        time.sleep(delay)\n"
        "    if ctx.rank == fail_rank:\n"
        "        raise ValueError(f'exploded on rank {ctx.rank}')\n"
        "    return {'rank': ctx.rank, 'pid': os.getpid()}\n")
    return d


def write_spec(directory: Path, text: str, name: str = "diloco.toml") -> Path:
    path = directory / name
    path.write_text(text)
    return path


def marker_spec(project: Path, module: str, source: str, *, replicas: int, args: str, restart: str = "",
                top: str = "") -> tuple[Path, Path]:
    """A local spec running `module:main` (written from `source`) with its `marker_dir` argument,
    polled and relaunched fast; the spec and the directory where its attempts leave markers."""
    (project / f"{module}.py").write_text(source)
    markers = project / "markers"
    markers.mkdir(exist_ok=True)
    return write_spec(project, f'backend = "local"\nreplicas = {replicas}\nentrypoint = "{module}:main"\n{top}\n'
                               f'[args]\nmarker_dir = "{markers}"\n{args}\n'
                               f'[restart]\nmonitor_interval = 0.05\nbackoff = 0.05\n{restart}\n'), markers


def status_json(cli, run_id: str) -> dict:
    """`diloco status RUN --json`, read."""
    import json

    return json.loads(cli("status", run_id, "--json").stdout)


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.05) -> bool:
    """Poll `predicate` until it holds or `timeout` passes; its last value. Tests wait on a
    condition, never for a fixed time."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def one_line_error(proc, expected: str) -> None:
    """The CLI refused in one line: exit 2, a single `error: ...` line on stderr that holds `expected`."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], proc.stderr
