"""The entrypoint `bench/launch.py` times a replica's start with: the runtime imported and one
inner optimizer step taken, as every DiLoCo replica's start does."""

from __future__ import annotations

import resource
import time


def first_step() -> dict:
    import torch

    import diloco_replica  # noqa: F401 - what a replica imports

    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()  # imports torch._dynamo (torch/optim/optimizer.py)
    pss_kb = 0
    try:
        for line in open("/proc/self/smaps_rollup"):
            if line.startswith("Pss:"):
                pss_kb = int(line.split()[1])
    except OSError:
        pass
    return {"stepped_at": time.time(), "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "pss_mb": pss_kb / 1024}
