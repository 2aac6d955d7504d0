"""A training job's output from CloudWatch Logs: group /aws/sagemaker/TrainingJobs, one stream
per instance start (`<job>/algo-1-<epoch>`), every start of the job in order.

Before the first stream exists the answer is a placeholder naming the job's state and where
its logs will be; while CloudWatch Logs throttles beyond the retries, one saying so (logs are
read again on the next call: nothing is lost).
"""

from __future__ import annotations

from typing import Any


from . import status as st
from diloco.errors import BackendError

from .aws import Aws, Transient

LOG_GROUP = "/aws/sagemaker/TrainingJobs"


def read_logs(aws: Aws, md: dict[str, Any], n_lines: int) -> str:
    """The last `n_lines` lines the job `md["job"]` printed, over all its instance starts."""
    try:
        return _read(aws, md, n_lines)
    except Transient as exc:
        return f"(the logs of {md['job']} cannot be read right now: {exc}; try again)\n"


def _read(aws: Aws, md: dict[str, Any], n_lines: int) -> str:
    logs = aws.client("logs", md.get("region"))
    try:
        streams = aws.call(f"list the log streams of {md['job']}", logs.describe_log_streams,
                           logGroupName=LOG_GROUP, logStreamNamePrefix=f"{md['job']}/")["logStreams"]
    except Transient:
        raise
    except BackendError as exc:
        if "ResourceNotFoundException" not in str(exc):
            raise
        streams = []
    lines: list[str] = []
    for stream in sorted(streams, key=lambda s: (s.get("creationTime", 0), s["logStreamName"])):
        events = aws.call(f"read {stream['logStreamName']}", logs.get_log_events, logGroupName=LOG_GROUP,
                          logStreamName=stream["logStreamName"], startFromHead=False,
                          limit=max(1, min(n_lines, 10000)))["events"]
        for e in events:
            lines.extend(e["message"].rstrip("\n").split("\n"))
    lines = lines[-n_lines:]
    if not lines:
        job = aws.describe(md)
        where = st.detail(job) if job else "no such job"
        return (f"(no output yet from {md['job']}: {where or 'starting'}; CloudWatch Logs {LOG_GROUP}, "
                f"stream {md['job']}/algo-1-…)\n")
    return "\n".join(lines) + "\n"
