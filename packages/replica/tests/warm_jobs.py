"""Entrypoints the warm-start tests run: what a replica sees of its own process."""

from __future__ import annotations

import os
import random
import sys
import time


def whoami(ctx, code: int = 0, sleep_s: float = 0.0, mark: str = "") -> dict:
    import atexit
    import threading

    import numpy

    if mark:  # what an exit does: join the threads left running, then run the atexit handlers
        def late(suffix: str) -> None:
            time.sleep(0.3)
            open(f"{mark}-{ctx.rank}.{suffix}", "w").close()

        threading.Thread(target=late, args=("thread",)).start()
        atexit.register(lambda: open(f"{mark}-{ctx.rank}.atexit", "w").close())
    time.sleep(sleep_s)
    if ctx.rank == 1 and code:
        sys.exit(code)
    if ctx.rank == 2 and code:
        os.kill(os.getpid(), 9)
    return {"pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0), "rank": os.environ.get("REPLICA_RANK"),
            "attempt": ctx.attempt, "argv0": sys.argv[0], "cwd": os.getcwd(), "numpy": float(numpy.random.rand()),
            "random": random.random(), "torch_loaded": "torch" in sys.modules, "stdin": sys.stdin.read(),
            "crc32c_sw_mode": os.environ.get("CRC32C_SW_MODE")}
