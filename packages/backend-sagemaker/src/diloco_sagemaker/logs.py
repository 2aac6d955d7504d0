"""A training job's output from CloudWatch Logs: group /aws/sagemaker/TrainingJobs, one stream
per instance start (`<job>/algo-1-<epoch>`), every start of the job in order.

Before the first stream exists the answer is a placeholder naming the job's state and where
its logs will be.
"""

from __future__ import annotations

from typing import Any

from diloco.errors import BackendError, UserError

from . import status as st
from .aws import Aws

LOG_GROUP = "/aws/sagemaker/TrainingJobs"


def read_logs(aws: Aws, md: dict[str, Any], n_lines: int) -> str:
    """The last `n_lines` lines the job `md["job"]` printed, over all its instance starts."""
    from botocore.exceptions import ClientError

    logs = aws.client("logs", md.get("region"))
    try:
        streams = aws.call(f"list the log streams of {md['job']}", logs.describe_log_streams,
                           logGroupName=LOG_GROUP, logStreamNamePrefix=f"{md['job']}/")["logStreams"]
    except UserError:
        raise
    except BackendError as exc:
        if "ResourceNotFoundException" not in str(exc):
            raise
        streams = []
    lines: list[str] = []
    for stream in sorted(streams, key=lambda s: (s.get("creationTime", 0), s["logStreamName"])):
        try:
            events = logs.get_log_events(logGroupName=LOG_GROUP, logStreamName=stream["logStreamName"],
                                         startFromHead=False, limit=max(1, min(n_lines, 10000)))["events"]
        except ClientError as exc:
            raise aws.client_error(f"read {stream['logStreamName']}", exc) from None
        for e in events:
            lines.extend(e["message"].rstrip("\n").split("\n"))
    lines = lines[-n_lines:]
    if not lines:
        job = aws.describe(md)
        where = st.detail(job) if job else "no such job"
        return (f"(no output yet from {md['job']}: {where or 'starting'}; CloudWatch Logs {LOG_GROUP}, "
                f"stream {md['job']}/algo-1-…)\n")
    return "\n".join(lines) + "\n"
