"""A small regression model for the progress, timeline and estimate tests.

`slow_rank` sleeps `slow_s` after each of its inner steps, and 40 × `slow_s` before its first,
so it is every round's straggler by construction (round 1 too: the replicas leave the start-up
barrier up to a poll interval apart, as much as a round's handicap); `eval_every` reports an eval loss every that many steps, as a real entrypoint would.
"""

from __future__ import annotations

import time

import torch

from diloco.bootstrap.context import ReplicaContext


def regress(ctx: ReplicaContext, dim: int = 256, width: int = 512, slow_rank: int = -1, slow_s: float = 0.0,
            eval_every: int = 0, step_s: float = 0.0) -> dict:
    """MLP regression; the run's length is the spec's [diloco] total_steps."""
    from diloco_replica import DiLoCo

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(dim, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    diloco = DiLoCo(model, opt, ctx)
    target = torch.randn(dim, generator=torch.Generator().manual_seed(7))
    if ctx.rank == slow_rank:
        time.sleep(40 * slow_s)
    for step in diloco.steps():
        g = torch.Generator().manual_seed(10_000 * ctx.rank + step)
        x = torch.randn(32, dim, generator=g)
        loss = ((model(x).squeeze(-1) - x @ target) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step_s:
            time.sleep(step_s)
        if ctx.rank == slow_rank:
            time.sleep(slow_s)
        diloco.step(loss=loss.item(), tokens=32)
        if eval_every and ctx.rank == 0 and (step + 1) % eval_every == 0:
            with torch.no_grad():
                x = torch.randn(256, dim, generator=torch.Generator().manual_seed(99))
                diloco.report_eval(((model(x).squeeze(-1) - x @ target) ** 2).mean().item())
    digest = diloco.theta_digest()
    diloco.close()
    return {"theta_digest": digest, "rounds": diloco.round}
