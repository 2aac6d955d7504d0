"""A real OpenSSH server on 127.0.0.1 for tests of `[backend] host`: keys, host key and config made in a
temp dir, `sshd -D -f <config>` on a port the OS picked, stopped by its pid.

`ssh_config` is the client side a user would have in ~/.ssh/config: a Host alias with the port, the
key made for the test, and a known_hosts file holding the server's host key (strict checking on).
The backend reaches it with `host = ALIAS` and `ssh_config = <that file>`.
"""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from .cluster import free_port

ALIAS = "slurm-over-ssh"


def sshd_installed() -> bool:
    return bool(shutil.which("sshd") or Path("/usr/sbin/sshd").exists()) and bool(shutil.which("ssh"))


@dataclass
class LoopbackSshd:
    root: Path
    port: int = 0
    pid: int | None = None

    @property
    def ssh_config(self) -> Path:
        return self.root / "ssh_config"

    def _keygen(self, path: Path) -> str:
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
        return path.with_suffix(".pub").read_text().strip()

    def start(self, timeout: float = 30.0) -> LoopbackSshd:
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        host_pub = self._keygen(self.root / "host_key")
        user_pub = self._keygen(self.root / "id_ed25519")
        (self.root / "authorized_keys").write_text(user_pub + "\n")
        self.port = free_port()
        (self.root / "sshd_config").write_text(f"""Port {self.port}
ListenAddress 127.0.0.1
HostKey {self.root}/host_key
AuthorizedKeysFile {self.root}/authorized_keys
PidFile {self.root}/sshd.pid
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
PermitRootLogin prohibit-password
StrictModes no
UsePAM no
""")
        (self.root / "known_hosts").write_text(f"[127.0.0.1]:{self.port} {' '.join(host_pub.split()[:2])}\n")
        self.ssh_config.write_text(f"""Host {ALIAS}
  HostName 127.0.0.1
  Port {self.port}
  User {getpass.getuser()}
  IdentityFile {self.root}/id_ed25519
  IdentitiesOnly yes
  UserKnownHostsFile {self.root}/known_hosts
  StrictHostKeyChecking yes
""")
        if os.geteuid() == 0:
            Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
        sshd = shutil.which("sshd") or "/usr/sbin/sshd"
        log = open(self.root / "sshd.log", "ab")  # noqa: SIM115 - kept by the daemon
        self.pid = subprocess.Popen([sshd, "-D", "-e", "-f", str(self.root / "sshd_config")], stdout=log,
                                    stderr=log, stdin=subprocess.DEVNULL, start_new_session=True).pid
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            probe = subprocess.run(["ssh", "-F", str(self.ssh_config), "-o", "BatchMode=yes", ALIAS, "true"],
                                   capture_output=True, text=True)
            if probe.returncode == 0:
                return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"sshd on 127.0.0.1:{self.port} never let the test key in: {probe.stderr.strip()}; "
                           f"see {self.root}/sshd.log")

    def stop(self) -> None:
        """Close the shared connection the backend left open (ControlPersist), then stop sshd by its pid."""
        if self.pid is None:
            return
        from diloco_slurm.access import control_dir

        subprocess.run(["ssh", "-F", str(self.ssh_config), "-o", f"ControlPath={control_dir()}/%C", "-O", "exit",
                        ALIAS], capture_output=True, timeout=30)
        pid, self.pid = self.pid, None
        try:
            os.kill(pid, signal.SIGTERM)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass

    def __enter__(self) -> LoopbackSshd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["ALIAS", "LoopbackSshd", "sshd_installed"]
