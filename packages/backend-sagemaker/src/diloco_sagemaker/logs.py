"""A training job's output from CloudWatch Logs: group /aws/sagemaker/TrainingJobs, one stream
per instance start (`<job>/<host>-<epoch>`, the host algo-1 … algo-K), every start in order.

A job of one instance reads as its lines, start after start. A job of K instances (a replica of
`nodes = K`) interleaves its hosts' lines by time, each line after its host (`[algo-2] …`), so
one replica's nodes read as one log. Its result is node 0's alone (`read_result`): every process
of a replica prints the entrypoint's return value, and only the node holding process 0 speaks
for the replica — node 0 being the first host in lexicographic order, as the bootstrap numbers
them.

Before the first stream exists the answer is a placeholder naming the job's state and where
its logs will be; while CloudWatch Logs throttles beyond the retries, one saying so (logs are
read again on the next call: nothing is lost).
"""

from __future__ import annotations

from typing import Any

from diloco.errors import BackendError
from diloco.inputs.resultline import result_from_log

from . import status as st
from .aws import Aws, Transient

LOG_GROUP = "/aws/sagemaker/TrainingJobs"
RESULT_LINES = 20  # the runner prints the result last: its tail holds it


def host_of(stream: str, job: str) -> str:
    """The host a stream `<job>/<host>-<epoch>` is from."""
    rest = stream[len(job) + 1:] if stream.startswith(f"{job}/") else stream
    host, sep, epoch = rest.rpartition("-")
    return host if sep and epoch.isdigit() else rest


def read_logs(aws: Aws, md: dict[str, Any], n_lines: int) -> str:
    """The last `n_lines` lines the job `md["job"]` printed, over all its instances and starts."""
    try:
        return _read(aws, md, n_lines)
    except Transient as exc:
        return f"(the logs of {md['job']} cannot be read right now: {exc}; try again)\n"


def read_result(aws: Aws, md: dict[str, Any]) -> object:
    """The entrypoint's return value as node 0 printed it last (None: it printed none)."""
    streams = _streams(aws, md)
    if not streams:
        return None
    first = min(host_of(s["logStreamName"], md["job"]) for s in streams)
    latest = max((s for s in streams if host_of(s["logStreamName"], md["job"]) == first), key=_started)
    return result_from_log("\n".join(line for _, line in _events(aws, md, latest, RESULT_LINES)))


def _started(stream: dict[str, Any]) -> tuple[int, str]:
    return stream.get("creationTime", 0), stream["logStreamName"]


def _streams(aws: Aws, md: dict[str, Any]) -> list[dict[str, Any]]:
    logs = aws.client("logs", md.get("region"))
    try:
        return aws.call(f"list the log streams of {md['job']}", logs.describe_log_streams,
                        logGroupName=LOG_GROUP, logStreamNamePrefix=f"{md['job']}/")["logStreams"]
    except Transient:
        raise
    except BackendError as exc:
        if "ResourceNotFoundException" not in str(exc):
            raise
        return []


def _events(aws: Aws, md: dict[str, Any], stream: dict[str, Any], n_lines: int) -> list[tuple[int, str]]:
    """A stream's last events, as (timestamp, line) pairs."""
    logs = aws.client("logs", md.get("region"))
    events = aws.call(f"read {stream['logStreamName']}", logs.get_log_events, logGroupName=LOG_GROUP,
                      logStreamName=stream["logStreamName"], startFromHead=False,
                      limit=max(1, min(n_lines, 10000)))["events"]
    return [(e.get("timestamp", 0), line) for e in events for line in e["message"].rstrip("\n").split("\n")]


def _read(aws: Aws, md: dict[str, Any], n_lines: int) -> str:
    streams = sorted(_streams(aws, md), key=_started)
    hosts = {host_of(s["logStreamName"], md["job"]) for s in streams}
    lines: list[str] = []
    if len(hosts) <= 1:
        for stream in streams:
            lines.extend(line for _, line in _events(aws, md, stream, n_lines))
    else:  # by time across the hosts (a stable sort: each host's lines keep their order)
        timed = [(at, f"[{host_of(s['logStreamName'], md['job'])}] {line}")
                 for s in streams for at, line in _events(aws, md, s, n_lines)]
        lines = [line for _, line in sorted(timed, key=lambda pair: pair[0])]
    lines = lines[-n_lines:]
    if not lines:
        job = aws.describe(md)
        where = st.detail(job) if job else "no such job"
        return (f"(no output yet from {md['job']}: {where or 'starting'}; CloudWatch Logs {LOG_GROUP}, "
                f"stream {md['job']}/algo-1-…)\n")
    return "\n".join(lines) + "\n"
