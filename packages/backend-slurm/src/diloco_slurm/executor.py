"""SlurmExecutor: each replica attempt is one Slurm batch job, on this cluster or over ssh on another.

`plan` builds each rank's batch script and the sbatch command (`batchscript`), `submit` writes the
run's secrets to a 0600 file in the run directory and pipes each script to `sbatch --parsable`,
`jobstate` turns what Slurm and the run directory say into the replica's status, and `access`
runs every command here or over the user's own ssh. Handles hold the job id and the path stem of
the attempt's files, so `diloco status / logs / cancel / resume` reattach from any shell. A replica
of several nodes is one job of several nodes (`multinode`): still one job, one handle, one result.

A rank is relaunched alone as a new job (attempt + 1); a requeue (scontrol requeue, preemption
with requeue) keeps the job id and reads pending meanwhile, costing no budget; its next run is a
new incarnation of the attempt (`reruns`, DILOCO_RERUN), so no round waits for the run that ended. `poll` never turns
a failed read into an ending: if slurmctld does not answer, the status last seen stands.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from diloco.errors import BackendError, UserError
from diloco.bootstrap.failures import cause_from_log
from diloco.options import options_from
from diloco.protocol import Capabilities, ReplicaHandle, ReplicaResult, ReplicaStatus
from diloco.request import LaunchPlan, LaunchRequest
from diloco.host.statedir import state_dir
from diloco.submitting import start_each
from diloco.waiting import LastStatus, poll_until_terminal, unless_failed

from . import batchscript, jobstate, limits
from .access import ClusterAccess
from .options import SlurmOptions

UNKNOWN_JOB = "Invalid job id specified"
PARTITION_TIMEOUT = 20.0  # seconds a plan waits to learn the partition's MaxTime before going on without it


class SlurmExecutor:
    """One Slurm batch job per replica attempt (see the README's "On Slurm")."""

    backend_name = "slurm"
    Options = SlurmOptions
    # Without `host` the launcher runs where the cluster's shared filesystem is mounted (a login
    # node): a file:// rendezvous there is seen by every job. With `host` (below) it is not.
    capabilities = Capabilities(shares_launcher_filesystem=True, relaunches_one_rank=True, process_groups=True,
                                multi_node=True, inter_replica_network=False, preemption_signal="SIGUSR1", status_detail=True,
                                numbered_reruns=True, log_files=True)

    def __init__(self, options: SlurmOptions | None = None, /, **overrides: Any):
        self.options = options_from(type(self), options, overrides)
        self.access = ClusterAccess(self.options)
        remote = self.options.host is not None
        self.capabilities = replace(type(self).capabilities, preemption_signal=self.options.preemption_signal,
                                    shares_launcher_filesystem=not remote, log_files=not remote)
        self._last = LastStatus()  # per job id
        self._partitions: str | None = None  # `scontrol show partition -o` for the partition, once `_asked`
        self._asked = False

    # -- planning and launching ----------------------------------------------------------------

    def plan(self, request: LaunchRequest) -> LaunchPlan:
        """Per rank the exact sbatch command and the batch script it reads on stdin, the jobs' time
        limit inside the partition's MaxTime and their nodes inside its node limits (`diloco_slurm.limits`)."""
        text, partition = self._partition(), self.options.partition
        body = batchscript.batch_jobs(self.options, self.access, request, default_state_dir=str(state_dir()),
                                      default_python=sys.executable,
                                      max_minutes=limits.max_time_minutes(text, partition) if text else None,
                                      max_nodes=limits.max_nodes(text, partition) if text else None)
        return LaunchPlan(self.backend_name, request, body, format="json")

    def _partition(self) -> str | None:
        """`scontrol show partition -o` for the partition, asked once per executor; None when Slurm
        cannot be asked from here (a dry run away from the cluster): then nothing is checked."""
        if not self._asked:
            self._asked = True
            which = [self.options.partition] if self.options.partition else []
            try:
                answer = self.access.run(self.access.slurm("scontrol", "show", "partition", "-o", *which),
                                         timeout=PARTITION_TIMEOUT)
            except UserError:  # no Slurm client here
                answer = None
            self._partitions = answer.out if answer is not None and answer.ok else None
        return self._partitions

    def submit(self, plan: LaunchPlan) -> list[ReplicaHandle]:
        request, body = plan.request, plan.body
        self.access.make_dir(body["run_dir"])
        if body["secrets_file"]:
            self.access.write_private(body["secrets_file"]["path"], batchscript.secrets_file(request.secrets.reveal()))
        jobs = {job["rank"]: job for job in body["jobs"]}

        def start(rank: int) -> ReplicaHandle:
            job = jobs[rank]
            answer = self.access.run(_unwrap(self.access, job), input=batchscript.script_text(job["script"]))
            if answer.unreachable:
                raise UserError(answer.err)
            job_id = answer.out.strip().split(";")[0]  # --parsable: "id" or "id;cluster"
            if not answer.ok or not job_id.isdigit():
                raise BackendError(f"sbatch of {job['job_name']} on {self.access.where} failed: "
                                   f"{(answer.err or answer.out).strip() or 'no job id'}")
            return ReplicaHandle.of(request, rank, self.backend_name, job_id=job_id, job_name=job["job_name"],
                                    stem=job["stem"], cluster=self.access.where)

        return start_each(request.ranks, start, self.cancel, platform=f"Slurm on {self.access.where}", unit="job(s)")

    # -- observing -----------------------------------------------------------------------------

    def _slurm_view(self, job_id: str) -> jobstate.SlurmView | None | bool:
        """Slurm's view of the job; None if Slurm does not know it; False if Slurm did not answer."""
        answer = self.access.run(self.access.slurm("scontrol", "show", "job", "-o", job_id))
        if answer.ok:
            return jobstate.parse_scontrol(answer.out)
        if UNKNOWN_JOB not in answer.err:
            return False
        acct = self.access.run(self.access.slurm("sacct", "-n", "-P", "-X", "-o", "State,ExitCode,Reason",
                                                 "-j", job_id))
        return jobstate.parse_sacct(acct.out) if acct.ok else None

    def _facts(self, handle: ReplicaHandle) -> jobstate.JobFacts | None:
        md = handle.metadata
        if not str(md.get("job_id", "")).isdigit() or not str(md.get("stem", "")).startswith("/"):
            raise BackendError(f"rank {handle.rank}'s handle {dict(md)!r} names no Slurm job id and run directory: "
                               f"the run record was edited or is not a slurm run's")
        view = self._slurm_view(str(md["job_id"]))
        if view is False:
            return None
        stem = md["stem"]
        ended = view is None or view.state not in jobstate.WAITING | {"RUNNING"}
        names = [f"{stem}.cancelled", *([f"{stem}.result.json", f"{stem}.exit"] if ended else [])]
        files = self.access.read_many(names)
        if files is None:  # the run directory could not be read just now: no answer
            return None
        result = _json_object(files.get(f"{stem}.result.json"))
        exit_text = (files.get(f"{stem}.exit") or "").strip()
        return jobstate.JobFacts(str(md["job_id"]), view, result, int(exit_text) if exit_text.isdigit() else None,
                                 files[f"{stem}.cancelled"] is not None)

    def _verdict(self, handle: ReplicaHandle) -> jobstate.Verdict | None:
        facts = self._facts(handle)
        return None if facts is None else jobstate.decide(facts)

    def poll(self, handle: ReplicaHandle) -> ReplicaStatus:
        key = str(handle.metadata["job_id"])
        verdict = self._verdict(handle)
        if verdict is None:  # slurmctld did not answer: the status last seen stands
            return self._last.last(key)
        return self._last.saw(key, verdict.status)

    def status_detail(self, handle: ReplicaHandle) -> str | None:
        """Why the replica is waiting (Slurm's reason: Priority, Resources, a requeue's BeginTime hold)."""
        verdict = self._verdict(handle)
        if verdict is None:
            return f"Slurm on {self.access.where} did not answer; the status shown is the last one read"
        return verdict.detail or (verdict.cause if verdict.status is ReplicaStatus.CANCELLED else None)

    def reruns(self, handle: ReplicaHandle) -> int | None:
        """How often Slurm has requeued the job (its Restarts, which the next run reads as
        SLURM_RESTART_COUNT and the batch script exports as DILOCO_RERUN); None if Slurm did not
        answer or has forgotten the job (accounting's record of an ended job reads 0)."""
        job_id = str(handle.metadata.get("job_id", ""))
        if not job_id.isdigit():
            return None
        view = self._slurm_view(job_id)
        return view.restarts if isinstance(view, jobstate.SlurmView) else None

    def log_path(self, handle: ReplicaHandle) -> Path:
        """The job's output file (sbatch --output), which `diloco logs --follow` tails; without `host` only."""
        return Path(f"{handle.metadata['stem']}.log")

    def stream_logs(self, handle: ReplicaHandle, *, n_lines: int = 200) -> str:
        text = self.access.tail(f"{handle.metadata['stem']}.log", n_lines)
        if text is None:
            return f"(no output yet from rank {handle.rank} attempt {handle.attempt}: Slurm job " \
                   f"{handle.metadata['job_id']} has not started writing)\n"
        return text

    def collect(self, handles: Sequence[ReplicaHandle], *, timeout: float | None = None) -> list[ReplicaResult]:
        statuses = poll_until_terminal(self, handles, timeout=timeout, interval=0.5)
        return [self._result(h, s) for h, s in zip(handles, statuses)]

    def _result(self, handle: ReplicaHandle, status: ReplicaStatus) -> ReplicaResult:
        """`unless_failed`'s result, from the runner's result file; a failure in Slurm's words."""
        facts = self._facts(handle) if status.is_terminal else None
        verdict = jobstate.decide(facts) if facts else jobstate.Verdict(status)
        result = facts.result if facts else None
        done = unless_failed(handle, status, lambda: (result or {}).get("result"),
                             cancelled=verdict.cause or "cancelled")
        if done is not None:
            return done
        if result is not None and isinstance(result.get("error"), str):  # the runner's own account
            error, code = result["error"], result.get("exit_code")
        else:  # killed, timed out, preempted, lost: what Slurm and the job's output say
            tail = self.stream_logs(handle, n_lines=20).strip()
            first = verdict.cause or cause_from_log(tail) or f"Slurm job {handle.metadata['job_id']} failed"
            error, code = (f"{first}\nlast output:\n{tail}" if tail else first), verdict.exit_code
        return ReplicaResult.failed(handle, status, error, code)

    # -- stopping ------------------------------------------------------------------------------

    def cancel(self, handle: ReplicaHandle) -> None:
        """scancel, after leaving the marker that says diloco asked; a job that ended keeps its status."""
        md = handle.metadata
        verdict = self._verdict(handle)
        if verdict is not None and verdict.status.is_terminal:
            return
        self.access.touch(f"{md['stem']}.cancelled")
        answer = self.access.run(self.access.slurm("scancel", str(md["job_id"])))
        if answer.unreachable:
            raise UserError(answer.err)
        if not answer.ok and "already completing or completed" not in answer.err and UNKNOWN_JOB not in answer.err:
            raise BackendError(f"scancel {md['job_id']} on {self.access.where} failed: {answer.err.strip()}")


def _unwrap(access: ClusterAccess, job: dict[str, Any]) -> list[str]:
    """The command `access.run` wraps into the plan's exact argv (asserted equal: the plan is what runs)."""
    command = access.slurm("sbatch", "--parsable")
    if access.argv(command) != job["command"]:
        raise BackendError(f"the plan's sbatch command {job['command']} is not what this executor would run; "
                           f"plan and submit with the same [backend] options")
    return command


def _json_object(text: str | None) -> dict[str, Any] | None:
    """The runner's result file, if it is one: a JSON object with a string `status` (plain JSON, no pickle)."""
    try:
        data = json.loads(text) if text else None
    except ValueError:
        return None
    return data if isinstance(data, dict) and isinstance(data.get("status"), str) else None
