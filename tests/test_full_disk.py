"""A full disk, on real local runs over a real filesystem that fills: a tmpfs of a few MB
(mounting one needs root, or sudo without a password, as CI's Slurm install does, and the right
to mount; elsewhere these tests skip, saying why).

- The file:// store's filesystem fills mid-round: the replicas' writes fail with ENOSPC, which
  they wait out like an outage (`diloco.store.outage`), saying so in their logs; the launcher's
  write proof sees it too, so `diloco status` names the cause; once space is freed the run goes
  on and ends bit-identical, with nothing relaunched and nothing half-written read back.
- The launcher's state directory fills: the launcher stops with one line naming the directory
  and the command that takes over (`StateDirFull`), its records each whole (written atomically,
  appended lines that tore are skipped); the replicas train on, and `diloco resume` finishes the
  run once there is space.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import record_of, tiny_spec
from diloco.testing.scenarios import events_of, one_global_model, wait_for_round


def _sudo() -> list[str] | None:
    if os.geteuid() == 0:
        return []
    if shutil.which("sudo") and subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode == 0:
        return ["sudo", "-n"]
    return None


@pytest.fixture
def small_disk(tmp_path):
    """A 24 MB tmpfs, and a way to fill it (leaving `free_mb`) and to free it again."""
    sudo = _sudo()
    if sudo is None:
        pytest.skip("mounting a small filesystem needs root or passwordless sudo (CI has one)")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    mounted = subprocess.run([*sudo, "mount", "-t", "tmpfs", "-o", f"size=24m,uid={os.getuid()},mode=0700", "tmpfs",
                              str(mnt)], capture_output=True, text=True)
    if mounted.returncode != 0:  # root without the right to mount (a container without CAP_SYS_ADMIN)
        pytest.skip(f"cannot mount a small filesystem here: {mounted.stderr.strip()}")

    class Disk:
        path = mnt
        filler = mnt / "filler"

        def fill(self, free_mb: float = 0.0) -> None:
            stat = os.statvfs(mnt)
            free = stat.f_bavail * stat.f_frsize - int(free_mb * 2**20)
            # unbuffered: a write the disk refuses fails here, in the loop, never in a flush at close
            # (the replicas write meanwhile, so the space statvfs saw can be gone by then)
            with open(self.filler, "ab", buffering=0) as f:
                while free > 0:
                    try:
                        written = f.write(b"\0" * min(free, 2**20))
                    except OSError:
                        break
                    if not written:
                        break
                    free -= written

        def free(self) -> None:
            self.filler.unlink(missing_ok=True)

    try:
        yield Disk()
    finally:
        subprocess.run([*sudo, "umount", "-l", str(mnt)], check=False)


def spec(tmp_path: Path, rendezvous: str) -> Path:
    path = tiny_spec(tmp_path, steps=400, sync_every=20, replicas=2)
    text = path.read_text().replace("round_timeout = 120", "round_timeout = 8\ncheckpoint_every = 1")
    path.write_text(text.replace('timeout = 1800\n', f'timeout = 1800\nrendezvous = "{rendezvous}"\n', 1))
    return path


def launch(spec_path: Path, state: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "diloco", "run", str(spec_path), "--on-interrupt", "detach"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "DILOCO_STATE_DIR": str(state)})
    return proc, proc.stdout.readline().split()[1].rstrip(":")


def diloco(state: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diloco", *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "DILOCO_STATE_DIR": str(state)})


def test_a_store_whose_disk_fills_is_waited_for_and_the_run_goes_on_once_space_returns(tmp_path, small_disk):
    state = tmp_path / "state"
    proc, run_id = launch(spec(tmp_path, f"file://{small_disk.path}/store"), state)
    try:
        wait_for_round(state, run_id, 2)
        small_disk.fill()
        deadline = time.monotonic() + 90  # the launcher proves writes every 30 s
        while time.monotonic() < deadline and not any(e["event"] == "store_unreachable"
                                                      for e in events_of(state, run_id)):
            small_disk.fill()  # what the run's GC deletes meanwhile is taken again: the disk stays full
            time.sleep(0.5)
        said = " ".join(diloco(state, "status", run_id).stdout.split())
        stalled = max(e["round"] for e in events_of(state, run_id) if e["event"] == "round")
        small_disk.free()
        out, _ = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert "No space left on device" in said and "STORE UNREACHABLE" in said, said
    events = events_of(state, run_id)
    kinds = [e["event"] for e in events]
    assert "store_back" in kinds and not {"failed", "relaunch_scheduled", "diverged"} & set(kinds), kinds
    assert stalled < 20
    record = record_of(state, run_id)
    one_global_model(record)
    assert all(r["result"]["rounds"] == 20 for r in record["ranks"])
    logs = " ".join(p.read_text() for p in (state / "local").glob("*/rank-*.log"))
    assert "No space left on device" in logs and "serves requests again" in logs


def test_a_full_state_directory_stops_the_launcher_in_one_line_and_resume_finishes_the_run(tmp_path, small_disk):
    state = small_disk.path / "state"
    proc, run_id = launch(spec(tmp_path, f"file://{tmp_path}/store"), state)
    try:
        wait_for_round(state, run_id, 2)
        small_disk.fill()
        out, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 2, out
    last = out.strip().splitlines()[-1]
    assert f"the state directory {state} is full" in last and f"diloco resume {run_id}" in last, out
    assert "Traceback" not in out
    small_disk.free()
    resumed = diloco(state, "resume", run_id)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    record = record_of(state, run_id)
    assert record["state"] == "SUCCEEDED"
    one_global_model(record)
    assert diloco(state, "status", run_id).returncode == 0
