"""The DiLoCo API a training function uses.

    diloco = DiLoCo(model, inner_opt, ctx)              # joins the run (or rejoins it)
    for step in diloco.steps(total_steps):              # resumes at the global step
        loss = compute_loss(model, batch(step))
        loss.backward(); inner_opt.step(); inner_opt.zero_grad()
        diloco.step(loss=loss.item(), tokens=n_tokens)  # every H steps: a sync round

Every `sync_every` (H) inner steps: Δ = θ_global − θ_local, averaged across replicas through the
store, an outer SGD-Nesterov step on θ_global (lr 0.7, momentum 0.9 by default), θ_global copied
into the model. Inner optimizer state stays local. Settings come from the spec's [diloco]
table (ctx.settings) unless given as keyword arguments here.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from diloco.context import ReplicaContext
from diloco.metrics import metrics_key

from .allreduce import FellBehind, RoundResult, StoreAllReduce
from .globalstate import GlobalState

DEFAULTS: dict[str, Any] = {
    "sync_every": 50, "outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True, "transport": "fp32",
    "round_timeout": 300.0, "min_replicas": 1, "checkpoint_every": 10, "poll_interval": None, "poll_max": None,
}
# Waiting for objects costs requests. On a local store they are free, so poll finely; on S3 each
# LIST/GET is billed and throttled (~5,500 GET/s per prefix), so start at 50 ms and back off to 1 s.
POLL_BY_SCHEME = {"file": (0.005, 0.05), "memory": (0.005, 0.05), "s3": (0.05, 1.0)}


def inner_optimizer(params, *, lr: float = 4e-4, weight_decay: float = 0.1, betas=(0.9, 0.95)) -> torch.optim.AdamW:
    """The paper's inner optimizer: AdamW lr 4e-4, weight decay 0.1, betas (0.9, 0.95)."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas)


@dataclass
class RoundInfo:
    """What one sync round did, as recorded in the store's metrics."""

    round: int
    members: list[int]
    late: bool
    loss: float | None
    tokens: int
    bytes_up: int
    bytes_down: int
    compute_s: float
    sync_s: float


def _flatten(params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).to("cpu", torch.float32) for p in params])


class DiLoCo:
    def __init__(self, model: torch.nn.Module, inner_opt: torch.optim.Optimizer | None = None,
                 ctx: ReplicaContext | None = None, *, store=None, **settings: Any):
        self.ctx = ctx or ReplicaContext.from_env()
        unknown = sorted(set(settings) - set(DEFAULTS))
        if unknown:
            raise TypeError(f"unknown DiLoCo setting(s) {unknown}; known: {sorted(DEFAULTS)}")
        self.settings = {**DEFAULTS, **{k: v for k, v in self.ctx.settings.items() if k in DEFAULTS},
                         **{k: v for k, v in settings.items() if v is not None}}
        s = self.settings
        self.model, self.inner_opt = model, inner_opt
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.H = int(s["sync_every"])
        self.store = store if store is not None else self.ctx.store
        first, cap = POLL_BY_SCHEME.get(self.store.uri.split(":", 1)[0], POLL_BY_SCHEME["s3"])
        self.allreduce = StoreAllReduce(
            self.store, self.ctx.run_id, self.ctx.rank, self.ctx.world_size, codec=s["transport"],
            round_timeout=float(s["round_timeout"]), min_replicas=int(s["min_replicas"]),
            poll_interval=float(s["poll_interval"] or first), poll_max=float(s["poll_max"] or cap), log=self._log)
        self.state = GlobalState(self.allreduce, lr=float(s["outer_lr"]), momentum=float(s["outer_momentum"]),
                                 nesterov=bool(s["nesterov"]), checkpoint_every=int(s["checkpoint_every"]),
                                 log=self._log)
        self.state.bootstrap(_flatten(self.params))
        self._load_theta_into_model()
        self.local_steps = 0          # inner steps since the last sync
        self._losses: list[float] = []
        self._tokens = 0
        self._compute_start = time.monotonic()
        self.history: list[RoundInfo] = []

    # -- progress ----------------------------------------------------------------------------

    @property
    def round(self) -> int:
        """Rounds of the global model completed (the one this replica holds)."""
        return self.state.round

    @property
    def global_step(self) -> int:
        return self.state.round * self.H + self.local_steps

    def steps(self, total_steps: int) -> Iterator[int]:
        """Global step indices still to do; a rejoining replica starts where the run is."""
        while self.global_step < total_steps:
            yield self.global_step

    def step(self, loss: float | None = None, tokens: int = 0) -> RoundInfo | None:
        """Call after each inner optimizer step; syncs every H steps."""
        self.local_steps += 1
        if loss is not None:
            self._losses.append(float(loss))
        self._tokens += int(tokens)
        if self.local_steps >= self.H:
            return self.sync()
        return None

    # -- the round ---------------------------------------------------------------------------

    def sync(self) -> RoundInfo:
        compute_s = time.monotonic() - self._compute_start
        t0 = time.monotonic()
        delta = self.state.theta - _flatten(self.params)
        try:
            result: RoundResult = self.allreduce.reduce(self.state.round + 1, delta)
        except FellBehind as exc:
            return self._rejoin(str(exc), compute_s, t0)
        self.allreduce.phase("outer", result.round)
        self.state.apply(result.round, result.mean, result.members)
        if result.late:
            self.state.catch_up()  # others may be rounds ahead: adopt every completed round
        self._load_theta_into_model()
        sync_s = time.monotonic() - t0
        info = RoundInfo(round=result.round, members=result.members, late=result.late,
                         loss=sum(self._losses) / len(self._losses) if self._losses else None,
                         tokens=self._tokens, bytes_up=result.traffic.bytes_up,
                         bytes_down=result.traffic.bytes_down, compute_s=compute_s, sync_s=sync_s)
        self.history.append(info)
        self._write_metrics(info, result)
        self.local_steps, self._losses, self._tokens = 0, [], 0
        self._compute_start = time.monotonic()
        self.allreduce.phase("compute", result.round + 1)
        return info

    def _rejoin(self, why: str, compute_s: float, t0: float) -> RoundInfo:
        """Too far behind to take part: adopt the run's current global state, as a restart would."""
        self._log(f"{why}; rejoining from the latest checkpoint")
        self.state.bootstrap(self.state.theta)
        self._load_theta_into_model()
        info = RoundInfo(round=self.state.round, members=[], late=True, loss=None, tokens=self._tokens, bytes_up=0,
                         bytes_down=0, compute_s=compute_s, sync_s=time.monotonic() - t0)
        self.history.append(info)
        self.local_steps, self._losses, self._tokens = 0, [], 0
        self._compute_start = time.monotonic()
        return info

    def _load_theta_into_model(self) -> None:
        with torch.no_grad():
            offset = 0
            for p in self.params:
                n = p.numel()
                p.copy_(self.state.theta[offset:offset + n].view_as(p))
                offset += n

    def _write_metrics(self, info: RoundInfo, result: RoundResult) -> None:
        row = {"rank": self.ctx.rank, "attempt": self.ctx.attempt, **info.__dict__,
               "requests": {"puts": result.traffic.puts, "gets": result.traffic.gets,
                            "lists": result.traffic.lists}, "takeovers": result.takeovers, "t": time.time()}
        try:
            self.store.put(metrics_key(self.ctx.run_id, info.round, self.ctx.rank), json.dumps(row).encode())
        except Exception as exc:  # metrics are for people; never fail training over them
            self._log(f"could not write metrics for round {info.round}: {exc}")

    def _log(self, msg: str) -> None:
        self.ctx.log.info(msg)

    def close(self) -> None:
        self.allreduce.close()

    def __enter__(self) -> DiLoCo:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
