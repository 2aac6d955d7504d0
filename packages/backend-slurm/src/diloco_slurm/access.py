"""How the launcher reaches a Slurm cluster: its own shell, or the user's own ssh to a login host.

Every Slurm command and every read of a job's files goes through `ClusterAccess`, so one launcher
drives several clusters: `[backend] host = "user@login.example.edu"` wraps each command in the
user's `ssh` (BatchMode: it fails instead of asking; their ~/.ssh/config, agent and keys, or the
file `ssh_config` names). diloco stores no key, password or host entry. `slurm_conf` is passed as
`env SLURM_CONF=...` in front of each command, so it holds on the far side of ssh too.

Commands are argv lists; over ssh they are joined with `shlex.join` into the one string ssh hands
the remote shell, so no value is ever interpolated unquoted.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from diloco.errors import BackendError, UserError

from .options import SlurmOptions

COMMAND_TIMEOUT = 120.0  # a Slurm command or ssh hop that takes longer is treated as failing
CONTROL_PERSIST = 60  # seconds ssh keeps a shared connection open after its last command
# Each file read prints its size then its bytes, or "-" when it is absent (one ssh hop for all of them).
_READ_MANY = 'for p; do if [ -f "$p" ] && [ -r "$p" ]; then wc -c < "$p"; cat -- "$p"; else echo -; fi; done'


def control_dir() -> Path:
    """Where ssh keeps its shared-connection sockets (ControlPath): a private runtime directory, no secret in it."""
    return Path(tempfile.gettempdir()) / f"diloco-ssh-{os.getuid()}"


@dataclass(frozen=True)
class Answer:
    code: int
    out: str
    err: str

    @property
    def ok(self) -> bool:
        return self.code == 0

    @property
    def unreachable(self) -> bool:
        """ssh itself failed (exit 255): a poll keeps the status last read; a submit stops with `err`."""
        return self.code == 255 and self.err.startswith("cannot reach ")


class ClusterAccess:
    """Runs commands where the cluster's Slurm client lives: here, or over ssh on `host`."""

    def __init__(self, options: SlurmOptions):
        self.host, self.ssh_config, self.slurm_conf = options.host, options.ssh_config, options.slurm_conf
        self.cluster = options.cluster

    @property
    def where(self) -> str:
        return f"{self.host} (over ssh)" if self.host else "this machine"

    def slurm(self, *argv: str) -> list[str]:
        """A Slurm client command with the cluster's selection (-M) added."""
        return [argv[0], *(("-M", self.cluster) if self.cluster else ()), *argv[1:]]

    def argv(self, command: list[str]) -> list[str]:
        """The exact argv this machine runs for `command` (what `diloco dryrun` shows)."""
        if self.slurm_conf:
            command = ["env", f"SLURM_CONF={self.slurm_conf}", *command]
        if not self.host:
            return command
        # One connection shared by every command (ControlMaster): a poll costs a round trip, not a handshake.
        ssh = ["ssh", *(("-F", self.ssh_config) if self.ssh_config else ()), "-o", "BatchMode=yes",
               "-o", "ControlMaster=auto", "-o", f"ControlPath={control_dir()}/%C",
               "-o", f"ControlPersist={CONTROL_PERSIST}"]
        return [*ssh, "--", self.host, shlex.join(command)]

    def run(self, command: list[str], *, input: str | None = None, timeout: float = COMMAND_TIMEOUT) -> Answer:
        done = self._run(command, input.encode() if input is not None else None, timeout)
        if isinstance(done, Answer):
            return done
        return Answer(done.returncode, done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace"))

    def _run(self, command: list[str], input: bytes | None, timeout: float) -> subprocess.CompletedProcess | Answer:
        argv = self.argv(command)
        if self.host:
            control_dir().mkdir(mode=0o700, exist_ok=True)
        try:
            done = subprocess.run(argv, input=input, capture_output=True, timeout=timeout,
                                  stdin=None if input is not None else subprocess.DEVNULL)
        except FileNotFoundError:
            tool = argv[0]
            raise UserError(f"`{tool}` is not installed on {'this machine' if tool == 'ssh' else self.where}: "
                            f"{'install an ssh client' if tool == 'ssh' else 'run diloco where Slurm client commands work, or set [backend] host'}") from None
        except subprocess.TimeoutExpired:
            return Answer(124, "", f"{command[0]} on {self.where} did not answer within {timeout:.0f}s")
        if self.host and done.returncode == 255:  # ssh's own failure: unreachable, refused, no key
            last = (done.stderr.decode(errors="replace").strip().splitlines() or ["no answer"])[-1]
            return Answer(255, "", f"cannot reach {self.host} over ssh: {last}; check that `ssh {self.host} true` "
                                   f"works without a prompt (your ssh config, agent and keys; diloco stores none)")
        if done.returncode == 127 and b"not found" in done.stderr:
            raise UserError(f"`{command[0]}` is not found on {self.where}: Slurm's client commands must be on "
                            f"its PATH")
        return done

    def check(self, what: str, command: list[str], *, input: str | None = None) -> str:
        """Run `command`; its stdout, or a BackendError naming `what` and Slurm's own words."""
        answer = self.run(command, input=input)
        if answer.unreachable:
            raise UserError(answer.err)
        if not answer.ok:
            raise BackendError(f"{what} on {self.where} failed: {answer.err.strip() or answer.out.strip()}")
        return answer.out

    # -- files in the run directory (the cluster's shared filesystem) ---------------------------

    def read_many(self, paths: list[str]) -> dict[str, str | None] | None:
        """Several small files at once (one command, one ssh hop): each one's text, or None if absent;
        None for all of it when the read itself failed (ssh down, a timeout)."""
        done = self._run(["sh", "-c", _READ_MANY, "sh", *paths], None, COMMAND_TIMEOUT)
        if isinstance(done, Answer) or done.returncode != 0:
            return None
        out: dict[str, str | None] = dict.fromkeys(paths)
        data, at = done.stdout, 0
        for path in paths:
            end = data.find(b"\n", at)
            if end < 0:
                break
            head = data[at:end].strip()
            if head == b"-" or not head.isdigit():
                at = end + 1
                continue
            size = int(head)
            out[path] = data[end + 1:end + 1 + size].decode(errors="replace")
            at = end + 1 + size
        return out

    def tail(self, path: str, n_lines: int) -> str | None:
        answer = self.run(["tail", "-n", str(int(n_lines)), "--", path])
        return answer.out if answer.ok else None

    def write_private(self, path: str, text: str) -> None:
        """Write `text` to `path` with mode 0600 (its directory made 0700), from stdin: never on a command line."""
        self.check(f"writing {path}", ["sh", "-c", 'umask 077 && mkdir -p -- "$(dirname -- "$1")" && cat > "$1"',
                                       "sh", path], input=text)

    def make_dir(self, path: str) -> None:
        self.check(f"creating {path}", ["sh", "-c", 'umask 077 && mkdir -p -- "$1"', "sh", path])

    def touch(self, path: str) -> None:
        self.check(f"writing {path}", ["sh", "-c", 'umask 077 && : > "$1"', "sh", path])
