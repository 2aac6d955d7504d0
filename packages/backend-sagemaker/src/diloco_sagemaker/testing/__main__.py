"""`python -m diloco_sagemaker.testing serve ROOT --aws-endpoint URL`: the control plane as its own process.

Prints `endpoint: http://127.0.0.1:PORT` and then one `env: NAME=VALUE` line per variable the
launcher's shell needs (`FakeSageMaker.env`) once it serves; runs until SIGTERM, then stops every job.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from . import FakeSageMaker


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m diloco_sagemaker.testing")
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("root")
    parser.add_argument("--aws-endpoint", required=True)
    parser.add_argument("--grace-seconds", type=float, default=None, help="SIGTERM → SIGKILL (SageMaker: 120)")
    args = parser.parse_args()
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    extra = {} if args.grace_seconds is None else {"grace_seconds": args.grace_seconds}
    with FakeSageMaker(Path(args.root), aws_endpoint=args.aws_endpoint, **extra) as plane:
        print(f"endpoint: {plane.endpoint}", flush=True)
        for k, v in plane.env.items():
            print(f"env: {k}={v}", flush=True)
        done.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
