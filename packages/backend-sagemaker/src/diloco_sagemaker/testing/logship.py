"""Container output to CloudWatch Logs, as SageMaker's log agent ships it: one event per line,
batched, in order, within a moment even while the output pauses; and a local copy per job.

Group /aws/sagemaker/TrainingJobs, one stream per instance start (`<job>/algo-1-<epoch ms>`).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

LOG_GROUP = "/aws/sagemaker/TrainingJobs"


class LogShipper:
    """Container output → CloudWatch Logs (one event per line, batched), and a local copy."""

    def __init__(self, logs: Any, stream: str, local: Path):
        self.logs, self.stream, self.local = logs, stream, open(local, "ab")
        try:
            logs.create_log_group(logGroupName=LOG_GROUP)
        except logs.exceptions.ResourceAlreadyExistsException:
            pass
        logs.create_log_stream(logGroupName=LOG_GROUP, logStreamName=stream)
        self.pending: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.done = threading.Event()
        threading.Thread(target=self._flush_every, args=(0.3,), daemon=True).start()

    def _flush_every(self, seconds: float) -> None:
        """Like the CloudWatch agent: lines show up within a moment even when output pauses."""
        while not self.done.wait(seconds):
            self.flush()

    def pump(self, pipe: Any) -> None:
        for raw in pipe:
            self.local.write(raw)
            self.local.flush()
            line = raw.decode("utf-8", "replace").rstrip("\n")
            with self.lock:
                self.pending.append({"timestamp": int(time.time() * 1000), "message": line})
            if len(self.pending) >= 100:
                self.flush()
        self.flush()

    def flush(self) -> None:
        with self.lock:  # one batch at a time, in order
            batch, self.pending = self.pending, []
            if batch:
                self.logs.put_log_events(logGroupName=LOG_GROUP, logStreamName=self.stream, logEvents=batch)

    def close(self) -> None:
        self.done.set()
        self.flush()
        self.local.close()
