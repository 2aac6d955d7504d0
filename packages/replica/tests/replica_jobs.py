"""Entrypoints the replica tests run as real processes (through diloco's local executor)."""

from __future__ import annotations

import json
import os
import time
import zlib

import torch

from diloco.bootstrap.context import ReplicaContext
from diloco_replica import DiLoCo
from diloco_replica.round.allreduce import StoreAllReduce


def theta_crc(diloco: DiLoCo) -> int:
    return zlib.crc32(diloco.theta.numpy().tobytes())


def linear_data(rank: int, step: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(8, dim, generator=g)
    y = x @ torch.arange(1.0, dim + 1) + 0.1 * torch.randn(8, generator=g)
    return x, y


def sgd_linear(ctx: ReplicaContext, steps: int = 6, dim: int = 5, lr: float = 0.05) -> dict:
    """H=1 DiLoCo with inner SGD on a linear model: must equal data-parallel SGD."""
    torch.manual_seed(0)
    model = torch.nn.Linear(dim, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    diloco = DiLoCo(model, opt, ctx)
    for step in diloco.steps(steps):
        x, y = linear_data(ctx.rank, step, dim)
        loss = ((model(x).squeeze(-1) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        diloco.step(loss=loss.item())
    diloco.close()
    return {"theta": diloco.theta.tolist()}


def gloo_vs_store_then_sgd_linear(ctx: ReplicaContext, numel: int = 100_003, init_file: str = "", steps: int = 6,
                                  dim: int = 5, lr: float = 0.05) -> dict:
    """`gloo_vs_store` (under a run of its own, beside this one), then `sgd_linear`: two checks
    of a few milliseconds each, one launch of replicas (a replica's start costs seconds)."""
    return {**gloo_vs_store(ctx, numel, init_file, run_id=f"{ctx.run_id}-gloo"), **sgd_linear(ctx, steps, dim, lr)}


def gloo_vs_store(ctx: ReplicaContext, numel: int = 100_003, init_file: str = "", run_id: str = "") -> dict:
    """The same random tensor through torch.distributed gloo all_reduce and the store."""
    import torch.distributed as dist

    x = torch.randn(numel, generator=torch.Generator().manual_seed(ctx.rank))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=ctx.rank, world_size=ctx.world_size)
    ref = x.clone()
    dist.all_reduce(ref)
    ref /= ctx.world_size
    dist.destroy_process_group()
    ar = StoreAllReduce(ctx.store, run_id or ctx.run_id, ctx.rank, ctx.world_size, round_timeout=60)
    res = ar.run_round(1, x)
    ar.close()
    return {"max_abs_diff": float((res.mean - ref).abs().max()), "crc": zlib.crc32(res.mean.numpy().tobytes()),
            "bytes_up": res.traffic.bytes_up, "bytes_down": res.traffic.bytes_down, "members": res.members}


def mlp_rounds(ctx: ReplicaContext, steps: int = 12, dim: int = 64, delay_rank: int = -1, delay_before_round: int = 0,
               delay_s: float = 0.0, join_after_round: int = 0, hold_before_round: int = 0, crash_at_step: int = -1, perturb_rank: int = -1,
               perturb_round: int = 0, nan_ranks: tuple[int, ...] = (), nan_step: int = -1,
               slow_ranks: tuple[int, ...] = (), step_sleep: float = 0.0, cuda_ranks: tuple[int, ...] = (),
               threads: dict[str, int] | None = None) -> dict:
    """A small MLP under DiLoCo with Adam; records θ's hash after every round.

    delay_rank sleeps `delay_s` before its sync of round `delay_before_round` (to miss it);
    join_after_round: join once rank 0's row of that round is in the store, and (the others) hold
    before round `hold_before_round` until it has joined; crash_at_step makes attempt 0 of the rank exit abruptly;
    perturb_rank adds 1e-3 to one element of its θ_global after round `perturb_round` (a bit flip
    in host memory, as far as DiLoCo can tell); nan_ranks' parameters turn NaN after inner step
    `nan_step` (a diverged step: the following inner steps poison AdamW's moments too);
    slow_ranks sleep `step_sleep` every inner step (a slower GPU); cuda_ranks train on the GPU;
    `threads` sets torch's threads per rank (str(rank) -> n), the training process's and its sync
    process's. Each inner step counts one token.
    """
    if join_after_round:  # a late start, however slowly the others got going
        from diloco.store.runkeys import RunKeys

        while ctx.store.get(RunKeys(ctx.run_id).metrics(join_after_round, 0)) is None:
            time.sleep(0.05)
    if threads and str(ctx.rank) in threads:
        from diloco.inputs.envvars import ENV_SYNC_THREADS

        torch.set_num_threads(threads[str(ctx.rank)])
        os.environ[ENV_SYNC_THREADS] = str(threads[str(ctx.rank)])
    device = "cuda" if ctx.rank in cuda_ranks else "cpu"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.Tanh(), torch.nn.Linear(4 * dim, 1)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    diloco = DiLoCo(model, opt, ctx)
    if join_after_round:
        ctx.store.put(f"{ctx.run_id}/test/joined", b"")
    hashes = {}
    rounds = []
    for step in diloco.steps(steps):
        if hold_before_round and not join_after_round and step + 1 == hold_before_round * diloco.stride:
            while ctx.store.get(f"{ctx.run_id}/test/joined") is None:  # the late one is in before this round
                time.sleep(0.05)
        if step == crash_at_step and ctx.attempt == 0:
            os._exit(17)
        g = torch.Generator().manual_seed(1000 * ctx.rank + step)
        x = torch.randn(16, dim, generator=g).to(device)
        loss = (model(x).squeeze(-1) - x.sum(-1)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if ctx.rank in nan_ranks and step == nan_step and ctx.attempt == 0:
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float("nan"))
        if ctx.rank == delay_rank and step + 1 == delay_before_round * diloco.stride:  # before round r starts
            time.sleep(delay_s)
        if ctx.rank in slow_ranks:
            time.sleep(step_sleep)
        info = diloco.step(loss=loss.item(), tokens=1)
        if info is not None and ctx.rank == perturb_rank and info.round == perturb_round and ctx.attempt == 0:
            diloco.sync.settle()  # round r's digest (written in the background) is of the state before the flip
            diloco.theta[0] += 1e-3
        if info is not None:
            hashes[info.round] = theta_crc(diloco)
            rounds.append({"round": info.round, "members": info.members, "member": info.member,
                           "bytes_up": info.bytes_up, "bytes_down": info.bytes_down, "loss": info.loss,
                           "tokens": info.tokens, "wait_s": info.phases.get("wait", 0.0)})
    diloco.close()
    finite = bool(torch.isfinite(diloco.theta).all()) and all(bool(torch.isfinite(p).all())
                                                                    for p in model.parameters())
    out = {"rank": ctx.rank, "hashes": hashes, "rounds": rounds, "final": theta_crc(diloco),
           "numel": diloco.theta.numel(), "finite": finite}
    print(json.dumps(out), flush=True)
    return out


def plain_lanes(ctx: ReplicaContext, steps: int = 8, dim: int = 16, fail_lane: int = -1, fail_kind: str = "",
                fail_step: int = -1, slow_lane: int = -1, step_sleep: float = 0.0) -> dict:
    """A plain module (no DDP) in each of a replica's processes: DiLoCo starts the group itself.

    Returns the whole model's hash after every round, per process (each process's own copy must
    hold θ_global after the lanes' broadcast). `fail_lane` raises at `fail_step`: a UserError
    ("config") or a ValueError ("bug"), to check what the replica as a whole reports. `slow_lane`
    sleeps `step_sleep` every inner step.
    """
    from diloco.errors import UserError

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.Tanh(), torch.nn.Linear(4 * dim, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    diloco = DiLoCo(model, opt, ctx)
    hashes = {}
    for step in diloco.steps(steps):
        if ctx.lane == fail_lane and step == fail_step:
            if fail_kind == "config":
                raise UserError("dataset path 'gs://nowhere' does not exist; fix `args.data`")
            raise ValueError("loss is NaN")
        g = torch.Generator().manual_seed(1000 * ctx.rank + 10 * ctx.lane + step)
        x = torch.randn(8, dim, generator=g)
        loss = (model(x).squeeze(-1) - x.sum(-1)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if ctx.lane == slow_lane:
            time.sleep(step_sleep)
        info = diloco.step(loss=loss.item())
        if info is not None:
            crc = 0
            for p in model.parameters():
                crc = zlib.crc32(p.detach().numpy().tobytes(), crc)
            hashes[info.round] = crc
    diloco.close()
    final = 0  # after the loop the model is θ_global, in every process of every replica
    for p in model.parameters():
        final = zlib.crc32(p.detach().numpy().tobytes(), final)
    out = {"rank": ctx.rank, "lane": ctx.lane, "hashes": hashes, "numel": diloco.view.numel, "final": final,
           "rounds": diloco.round}
    os.write(1, ("LANE-RESULT " + json.dumps(out) + "\n").encode())  # one write: the replica's processes share a log
    return out
