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

`model` may be a plain module, a DDP-wrapped one or an FSDP2 (`fully_shard`) one. In a replica
of L processes (torchrun) each process syncs its lane (`lanes`, `modelview`): 1/L of the
replicated parameters, or the shards it holds.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from diloco.context import ReplicaContext
from diloco.metrics import RoundMetrics
from diloco.spec import DILOCO
from diloco.store import verify_store

from .allreduce import RoundResult, StoreAllReduce
from .globalstate import GlobalState
from .lanes import Lanes
from .membership import FellBehind
from .modelview import model_view
from .recorder import Recorder

# One place for the defaults: the spec's [diloco] table (diloco.spec.DILOCO).
DEFAULTS: dict[str, Any] = {key: f.default for key, f in DILOCO.items()}
# Waiting for objects costs requests. On a local store they are free, so poll finely; on S3 each
# LIST/GET is billed and throttled (~5,500 GET/s per prefix), so start at 50 ms and back off to 1 s.
POLL_BY_SCHEME = {"file": (0.005, 0.05), "memory": (0.005, 0.05), "s3": (0.05, 1.0)}

RoundInfo = RoundMetrics  # what `DiLoCo.step` returns: the round's metrics row (one type, in diloco.metrics)


def inner_optimizer(params, *, lr: float = 4e-4, weight_decay: float = 0.1, betas=(0.9, 0.95)) -> torch.optim.AdamW:
    """The paper's inner optimizer: AdamW lr 4e-4, weight decay 0.1, betas (0.9, 0.95)."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas)


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
        self.lanes = Lanes.join(self.ctx.lanes, self.ctx.lane, self._log)
        self.view = model_view(model, self.lanes)  # what this process syncs: its lane of the model
        self.H = int(s["sync_every"])
        self.store = store if store is not None else self.ctx.store
        verify_store(self.store, self.ctx.run_id, f"rank-{self.ctx.rank}-{self.ctx.lane}-attempt-{self.ctx.attempt}")
        first, cap = POLL_BY_SCHEME.get(self.store.uri.split(":", 1)[0], POLL_BY_SCHEME["s3"])
        self.allreduce = StoreAllReduce(
            self.store, self.ctx.run_id, self.ctx.rank, self.ctx.world_size, codec=s["transport"],
            round_timeout=float(s["round_timeout"]), min_members=int(s["min_members"]),
            poll_interval=float(s["poll_interval"] or first), poll_max=float(s["poll_max"] or cap), log=self._log,
            lanes=self.lanes)
        on_cuda = any(t.device.type == "cuda" for t in self.view.tensors[:1])
        self.state = GlobalState(self.allreduce, self.view.numel, lr=float(s["outer_lr"]),
                                 momentum=float(s["outer_momentum"]), nesterov=bool(s["nesterov"]),
                                 checkpoint_every=int(s["checkpoint_every"]), log=self._log, pin=on_cuda)
        self.recorder = Recorder(self.allreduce, self._log)
        self.state.bootstrap(self.view.read)  # θ_0 from this replica's model if the run is new
        self.view.write(self.state.theta)
        self.local_steps = 0          # inner steps since the last sync
        self._losses: list[float] = []
        self._tokens = 0
        self._compute_start = time.monotonic()
        self._alone_since_start = self.ctx.world_size > 1  # until a round with another member is seen
        self.history: list[RoundMetrics] = []
        self._pending_row = None  # the last round's digest and metrics row, being written
        self.ctx.global_step = self.global_step

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

    def step(self, loss: float | None = None, tokens: int = 0) -> RoundMetrics | None:
        """Call after each inner optimizer step; syncs every H steps."""
        self.local_steps += 1
        if loss is not None:
            self._losses.append(float(loss))
        self._tokens += int(tokens)
        info = self.sync() if self.local_steps >= self.H else None
        self.ctx.global_step = self.global_step
        return info

    # -- the round ---------------------------------------------------------------------------

    def sync(self) -> RoundMetrics:
        compute_s = time.monotonic() - self._compute_start
        t0 = time.monotonic()
        self._wait_for_record()  # the previous round's digest must be of the state before this step
        since = self.state.round - 1
        diverged = self.lanes.on_leader(lambda: self.recorder.diverged_since(since)) if self.state.round > 0 else None
        if diverged is not None:
            self._log(f"this replica's global state diverged from the majority's at round {diverged}; "
                      f"reloading it from an older checkpoint")
            self.state.repair_divergence(diverged, None)
            self.recorder.skip_through(self.state.round)  # later summaries still show the old state
            return self._adopted(compute_s, t0)
        delta = self.view.read()
        torch.sub(self.state.theta, delta, out=delta)  # Δ = θ_global − θ_local, in the read buffer
        try:
            result: RoundResult = self.lanes.agree(
                lambda: self.allreduce.run_round(self.state.round + 1, delta, in_place=True))
        except FellBehind as exc:
            self._log(f"{exc}; rejoining from the latest checkpoint")
            self.state.bootstrap(None)
            return self._adopted(compute_s, t0)
        self.allreduce.phase("outer", result.round)
        self.state.apply(result.round, result.mean, result.members)
        result.mean = delta = None  # the round's one model-sized buffer (the mean was written over Δ)
        if not result.member:
            self.state.catch_up()  # others may be rounds ahead: adopt every completed round
        self.view.write(self.state.theta)
        # the replica's row: every lane's bytes, requests and tokens; the mean loss over its processes
        sums = self.lanes.total({"bytes_up": result.traffic.bytes_up, "bytes_down": result.traffic.bytes_down,
                                 **result.traffic.requests(), "tokens": self._tokens,
                                 "loss_sum": sum(self._losses), "loss_n": len(self._losses)})
        loss_sum, loss_n = sums.pop("loss_sum"), sums.pop("loss_n")
        info = RoundMetrics(
            round=result.round, rank=self.ctx.rank, attempt=self.ctx.attempt, members=result.members,
            member=result.member, loss=loss_sum / loss_n if loss_n else None, tokens=int(sums.pop("tokens")),
            bytes_up=int(sums.pop("bytes_up")), bytes_down=int(sums.pop("bytes_down")),
            compute_s=compute_s, sync_s=time.monotonic() - t0, requests={k: int(v) for k, v in sums.items()},
            takeovers=result.takeovers, incidents=result.incidents, t=time.time())
        self._warn_if_alone(info)
        self.history.append(info)
        # θ and the momentum stay as they are until the next round's outer step, so their digest
        # (a CRC over 8 bytes per parameter, ~2 GB/s) and the row's write overlap the next inner steps.
        self._pending_row = self.allreduce.pool.submit(self._record, info)
        self._next_phase()
        return info

    def _record(self, info: RoundMetrics) -> None:
        """The replica's row for the round: one per replica (lane 0 writes it), with the digest
        of every lane's state, so a divergence in any lane shows."""
        digests = self.lanes.exchange(self.state.digest())
        if self.lanes.leader:
            info.state_digest = "+".join(digests)
            self.recorder.write_row(info)
            self.recorder.maybe_summarize(info.round, info.members)

    def _wait_for_record(self) -> None:
        if self._pending_row is not None:
            self._pending_row.result()
            self._pending_row = None

    def _adopted(self, compute_s: float, t0: float) -> RoundMetrics:
        """Took no part in a round: adopted the run's state instead (rejoin or divergence repair)."""
        self.view.write(self.state.theta)
        info = RoundMetrics(round=self.state.round, rank=self.ctx.rank, attempt=self.ctx.attempt, member=False,
                            tokens=self._tokens, compute_s=compute_s, sync_s=time.monotonic() - t0, t=time.time())
        self.history.append(info)
        self._next_phase()
        return info

    def _next_phase(self) -> None:
        self.local_steps, self._losses, self._tokens = 0, [], 0
        self._compute_start = time.monotonic()
        self.allreduce.phase("compute", self.state.round + 1)

    def _warn_if_alone(self, info: RoundMetrics) -> None:
        if not self._alone_since_start or not self.lanes.leader:  # one warning per replica
            return
        if len(info.members) > 1:
            self._alone_since_start = False
            return
        self._log(f"WARNING: round {info.round}: this replica has been alone in every round so far although the run "
                  f"has {self.ctx.world_size} replicas; they are not meeting in the store {self.store.uri!r} "
                  f"(is it the same store for all of them?)")

    def _log(self, msg: str) -> None:
        self.ctx.log.info(msg)

    def close(self) -> None:
        self._wait_for_record()
        self.allreduce.close()
        self.lanes.close()

    def __enter__(self) -> DiLoCo:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
