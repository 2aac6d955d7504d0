"""The DiLoCo API a training function uses.

    diloco = DiLoCo(model, inner_opt, ctx)              # joins the run (or rejoins it)
    for step in diloco.steps(total_steps):              # resumes at the global step
        loss = compute_loss(model, batch(step))
        loss.backward(); inner_opt.step(); inner_opt.zero_grad()
        diloco.step(loss=loss.item(), tokens=n_tokens)  # every H steps: a sync round
        # optional: diloco.report_eval(eval_loss) puts an eval point in the run's metrics

Each round's row (`diloco.metrics.RoundMetrics`) says where the replica's time went
(`PHASES`: compute, upload, wait, reduce, download, outer; with overlap, how much of the
exchange ran hidden behind inner steps), how far the run is (global step of total), and the
model size, so the launcher can show progress, name stragglers and check its estimate.

Every `sync_every` (H) inner steps: Δ = θ_global − θ_local, averaged across replicas through the
store, an outer SGD-Nesterov step on θ_global (lr 0.7, momentum 0.9 by default), θ_global copied
into the model. Inner optimizer state stays local. Settings come from the spec's [diloco]
table (ctx.settings) unless given as keyword arguments here.

A replica whose update was left out of a round for NaN/Inf values (its training diverged; the
reducers say so in the reduced shards, `RoundResult.nonfinite`) resets: the whole model to
θ_global, the inner optimizer's state cleared (its moments hold NaN too), the topk residual
zeroed — what a relaunch would give, without one — and trains on, with an incident that says so.

`model` may be a plain module, a DDP-wrapped one or an FSDP2 (`fully_shard`) one. In a replica
of L processes (torchrun) each process syncs its lane (`lanes`, `modelview`): 1/L of the
replicated parameters, or the shards it holds.

Time-based rounds (`round_seconds = T`, for uneven GPUs): a round closes T seconds after it began
here, or at H steps if sooner; each contribution carries its step count and the mean is FedNova's
normalised average (docs/sync-modes.md). A round counts as H steps of the run's progress.

Hiding the sync (docs/sync-modes.md):
- `fragments = K` (Streaming DiLoCo): round r syncs fragment (r − 1) mod K, one round every H/K
  inner steps, so each fragment still syncs every H steps and a round moves 1/K of the model.
- `overlap = true` (eager/one-round-late outer steps): a round's exchange runs on a background
  thread while inner steps go on; its outer step is merged as soon as it has arrived (at the
  latest at the next round, which is the only time training waits for the store). The merge
  keeps the local progress made while the round was in flight: the fragment becomes
  θ_local + (θ_global_new − θ_local_at_sync), so the next Δ counts every inner step exactly once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from diloco.context import ReplicaContext
from diloco.errors import UserError
from diloco.metrics import RoundMetrics
from diloco.envvars import ENV_SETTINGS
from diloco.options import describe_options
from diloco.settings import DilocoSettings
from diloco.store import poll_defaults, verify_store

from .allreduce import RoundResult, StoreAllReduce
from .globalstate import GlobalState
from .lanes import Lanes
from .rounderrors import FellBehind
from .modelview import model_view
from .recorder import Recorder
from .roundclock import RoundClock
from .streaming import LiveDelta

# One place for the defaults: the [diloco] table's declaration, DilocoSettings.
DEFAULTS: dict[str, Any] = {o.name: o.default for o in describe_options(DilocoSettings)}



@dataclass
class BackgroundRound:
    """A round whose exchange runs in the background (overlap), merged one round late."""

    round: int
    part: int                   # the fragment it updates
    local: torch.Tensor         # the fragment's local parameters when the round began
    future: Future              # → RoundResult
    compute_s: float            # inner-step time of the phase the round closes
    blocked_s: float            # time the training loop spent starting it
    work: tuple[int, list[float], list[list[float]]]  # tokens, losses and evals of that phase


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
        # the launcher's settings, checked again here (nothing that arrives is trusted), then the keywords
        self.settings = s = DilocoSettings.from_table({**self.ctx.settings, **settings}, where=ENV_SETTINGS)
        self.model, self.inner_opt = model, inner_opt
        self.lanes = Lanes.join(self.ctx.lanes, self.ctx.lane, self._log, clock=s.round_seconds is not None)
        self.view = model_view(model, self.lanes)  # what this process syncs: its lane of the model
        self.H = int(s.sync_every)
        self.fragments = int(s.fragments)
        if self.fragments < 1 or self.H % self.fragments:
            raise UserError(f"diloco setting fragments={self.fragments} must divide sync_every={self.H}")
        self.stride = self.H // self.fragments  # inner steps between rounds
        self.overlap = bool(s.overlap)
        # time-based rounds: a round closes round_seconds after it began here, or at H steps if sooner
        self.round_seconds = float(s.round_seconds) if s.round_seconds is not None else None
        self.store = store if store is not None else self.ctx.store
        verify_store(self.store, self.ctx.run_id, f"rank-{self.ctx.rank}-{self.ctx.lane}-attempt-{self.ctx.attempt}")
        first, cap = poll_defaults(self.store.uri)
        self.allreduce = StoreAllReduce(
            self.store, self.ctx.run_id, self.ctx.rank, self.ctx.world_size, codec=s.transport,
            round_timeout=float(s.round_timeout), min_members=int(s.min_members),
            poll_interval=float(s.poll_interval or first), poll_max=float(s.poll_max or cap), log=self._log,
            lanes=self.lanes, topk_density=float(s.topk_density),
            step_cap=self.H if self.round_seconds is not None else None)
        on_cuda = any(t.device.type == "cuda" for t in self.view.tensors[:1])
        self.state = GlobalState(self.allreduce, self.view.numel, lr=float(s.outer_lr),
                                 momentum=float(s.outer_momentum), nesterov=bool(s.nesterov),
                                 checkpoint_every=int(s.checkpoint_every), log=self._log, pin=on_cuda,
                                 fragments=self.fragments)
        # topk's error feedback: what this lane has not sent yet. A (re)joining replica starts at zero.
        self.residual = torch.zeros(self.view.numel) if s.transport == "topk" else None
        self._inflight: BackgroundRound | None = None
        self._exchanger = ThreadPoolExecutor(1, thread_name_prefix="diloco-round") if self.overlap else None
        self.recorder = Recorder(self.allreduce, self._log)
        self.state.bootstrap(self.view.read)  # θ_0 from this replica's model if the run is new
        self.view.write(self.state.theta)
        self.local_steps = 0          # inner steps since the last sync
        self._losses: list[float] = []
        self._tokens = 0
        self._evals: list[list[float]] = []  # [global step, eval loss] reported since the last sync
        self.total_steps: int | None = s.total_steps
        self.clock = RoundClock(self.stride, self.round_seconds, self.lanes)  # when a round is due
        self._alone_since_start = self.ctx.world_size > 1  # until a round with another member is seen
        self.metrics: list[RoundMetrics] = []
        self._pending_row = None  # the last round's digest and metrics row, being written
        self.ctx.global_step = self.global_step

    # -- progress ----------------------------------------------------------------------------

    @property
    def round(self) -> int:
        """Rounds of the global model completed (the one this replica holds)."""
        return self.state.round

    @property
    def global_step(self) -> int:
        started = self._inflight.round if self._inflight is not None else self.state.round
        return started * self.stride + self.local_steps

    def steps(self, total_steps: int | None = None) -> Iterator[int]:
        """Global step indices still to do; a rejoining replica starts where the run is.

        `total_steps` defaults to the spec's [diloco] total_steps; the rows carry it, so the
        launcher's progress shows step / total and an ETA.

        When the loop ends the round still in flight (overlap) is merged and the model is set to
        θ_global, the state every replica agrees on, so what training code evaluates or saves
        after the loop is the global model on every replica. (Inner steps after the last round,
        and with fragments the other fragments' steps since their last round, are not in it.)
        """
        if total_steps is None:
            total_steps = self.total_steps
        if total_steps is None:
            raise UserError("DiLoCo.steps() needs the run's length: pass total_steps, or set [diloco] total_steps "
                            "in the spec")
        self.total_steps = int(total_steps)
        if self.round_seconds is not None and self.total_steps % self.H:
            raise UserError(f"with round_seconds, the run's length ({self.total_steps} steps) must be a multiple of "
                            f"sync_every ({self.H}): a round counts as sync_every steps, and a run that ends inside "
                            f"a round leaves its replicas on different models")
        while self.global_step < total_steps:
            yield self.global_step
        self.finish()
        self._wait_for_record()  # its lane exchange and the write below share the lanes' group
        self.view.write(self.state.theta)

    def step(self, loss: float | None = None, tokens: int = 0) -> RoundMetrics | None:
        """Call after each inner optimizer step; a round every sync_every/fragments steps (with
        round_seconds: at the round's deadline, or after sync_every steps).

        Returns the metrics row of a round when its outer step has been applied here. A
        non-finite `loss` is left out of the row's mean loss (rows are JSON, which has no NaN); a
        diverged replica shows as an incident when its update is left out, and resets.
        """
        self.allreduce.io.faults.after_step(self.global_step, self.view)  # fault injection; off by default
        self.local_steps += 1
        if loss is not None and math.isfinite(loss):  # a diverged step is an incident, not a NaN in JSON rows
            self._losses.append(float(loss))
        self._tokens += int(tokens)
        if self.clock.due(self.local_steps):
            info = self.sync()
        elif self._inflight is not None and self._inflight.future.done() and self.lanes.count == 1:
            info = self._merge()  # arrived: merge now (a replica of several processes merges at the next round)
        else:
            info = None
        self.ctx.global_step = self.global_step
        return info

    def report_eval(self, loss: float) -> None:
        """Record an evaluation of the model at the current global step; it goes into the next
        round's row (the loss curve and the timeline plot show it, TensorBoard gets it). A NaN or
        Inf loss is logged and left out: it is no point on a curve, and rows are JSON."""
        if not math.isfinite(float(loss)):
            self._log(f"eval loss at global step {self.global_step} is {loss}: not recorded (the model diverged?)")
        else:
            self._evals.append([self.global_step, float(loss)])
        self.clock.not_a_step()

    def finish(self) -> RoundMetrics | None:
        """Merge the round in flight, if any (overlap): wait for its result and apply it."""
        return self._merge() if self._inflight is not None else None

    # -- the round ---------------------------------------------------------------------------

    def sync(self) -> RoundMetrics | None:
        """Start the next round: run it here, or (overlap) hand it to the background thread.

        Returns the row of the round applied during this call: this round's, or with overlap
        the previous round's if it had not been merged yet (None if there was none).
        """
        compute_s = time.monotonic() - self.clock.phase_start
        merged = self._merge() if self._inflight is not None else None  # the one wait overlap has: a round late
        t0 = time.monotonic()  # (the merge's wait is in the merged round's row)
        self._wait_for_record()  # the previous round's digest must be of the state before this step
        since = self.state.round - 1
        diverged = self.lanes.on_leader(lambda: self.recorder.diverged_since(since)) if self.state.round > 0 else None
        if diverged is not None:
            self._log(f"this replica's global state diverged from the majority's at round {diverged}; "
                      f"reloading it from an older checkpoint")
            self.state.repair_divergence(diverged, None)
            self.recorder.skip_through(self.state.round)  # later summaries still show the old state
            return self._adopted(compute_s, t0)
        r = self.state.round + 1
        part = self.state.fragment(r)
        a, b = self.state.bounds(r)
        residual = self.residual[a:b] if self.residual is not None else None
        if self.overlap:  # training goes on during the exchange: Δ is a snapshot, and `local` is kept for the merge
            local = self.view.read_part(part, self.fragments)
            delta = torch.sub(self.state.theta[a:b], local)  # Δ = θ_global − θ_local
            future = self._exchanger.submit(self._exchange, r, delta, residual)
            self._inflight = BackgroundRound(r, part, local, future, compute_s, time.monotonic() - t0,
                                      (self._tokens, self._losses, self._evals))
            self._next_phase()
            return merged
        # Synchronous: the model stands still, so Δ is read from it a shard at a time and each
        # shard's outer step is applied as its mean arrives (`streaming`): no Δ or mean buffer.
        source = LiveDelta(self.state.theta[a:b], lambda lo, hi: self.view.read_range(part, self.fragments, lo, hi))
        self.state.begin(r)
        try:
            result = self._exchange(r, source, residual, sink=self.state.sink(r), steps=self.local_steps)
        except FellBehind as exc:
            self._log(f"{exc}; rejoining from the latest checkpoint")
            self.state.bootstrap(None)
            return self._adopted(compute_s, t0)
        return self._apply(result, part, None, compute_s, t0, 0.0, (self._tokens, self._losses, self._evals))

    def _exchange(self, r: int, delta, residual: torch.Tensor | None, sink=None, steps: int | None = None) -> RoundResult:
        """Round r's all-reduce of Δ (the mean written over it, or to `sink` shard by shard); every
        lane agrees on the outcome. `steps`: the inner steps behind Δ (time-based rounds weigh by it)."""
        return self.lanes.agree(lambda: self.allreduce.run_round(r, delta, in_place=True, residual=residual,
                                                                 sink=sink, steps=steps))

    def _merge(self) -> RoundMetrics:
        """Wait for the round in flight (if it has not arrived yet) and apply it."""
        flight, self._inflight = self._inflight, None
        t0 = time.monotonic()
        try:
            result = flight.future.result()
        except FellBehind as exc:
            self._log(f"{exc}; rejoining from the latest checkpoint")
            self._wait_for_record()
            self.state.bootstrap(None)
            return self._adopted(flight.compute_s, t0, next_phase=False)
        waited = time.monotonic() - t0
        self._wait_for_record()  # the last round's digest is of the state before this outer step
        return self._apply(result, flight.part, flight.local, flight.compute_s, t0, flight.blocked_s, flight.work,
                           hidden_s=max(0.0, result.seconds - waited))

    def _apply(self, result: RoundResult, part: int, local_at_sync: torch.Tensor | None, compute_s: float,
               t0: float, blocked_s: float, work: tuple[int, list[float], list[list[float]]], *,
               hidden_s: float = 0.0) -> RoundMetrics:
        """The round's outer step on θ_global, then its fragment into the model; the round's row."""
        self.allreduce.phase("outer", result.round)
        outer_t0 = time.monotonic()
        if result.mean is None:  # streamed: the outer step was applied shard by shard as each mean arrived
            self.state.finish(result.round, result.members)
        else:
            self.state.apply(result.round, result.mean, result.members)
            result.mean = None  # the round's one fragment-sized buffer (the mean was written over Δ)
        a, b = self.state.bounds(result.round)
        tokens, losses, evals = work
        # the replica's row: every lane's bytes, requests and tokens; the mean loss over its processes;
        # and whether any lane's update was left out for NaN/Inf (then every lane resets)
        sums = self.lanes.total({"bytes_up": result.traffic.bytes_up, "bytes_down": result.traffic.bytes_down,
                                 **result.traffic.requests(), "tokens": tokens,
                                 "loss_sum": sum(losses), "loss_n": len(losses), "parameters": self.view.numel,
                                 "nonfinite": int(self.ctx.rank in result.nonfinite)})
        left_out_nonfinite = sums.pop("nonfinite") > 0
        incidents = result.incidents + self.allreduce.io.take_found()  # + any met rejoining since the last row
        if not result.member:
            self.state.catch_up()  # others may be rounds ahead: adopt every completed round
            incidents += self.allreduce.io.take_found()
            self.view.write(self.state.theta)  # and the whole global model, as a rejoining replica does
        elif left_out_nonfinite:
            incidents += self._reset_to_global(result.round)
        elif local_at_sync is None:
            self.view.write_part(self.state.theta[a:b], part, self.fragments)
        else:  # overlap: keep the inner steps made since the round began, on top of the new global state
            now = self.view.read_part(part, self.fragments)
            now += self.state.theta[a:b]
            now -= local_at_sync
            self.view.write_part(now, part, self.fragments)
        outer_s = time.monotonic() - outer_t0
        loss_sum, loss_n = sums.pop("loss_sum"), sums.pop("loss_n")
        info = RoundMetrics(
            round=result.round, rank=self.ctx.rank, attempt=self.ctx.attempt, members=result.members,
            member=result.member, loss=loss_sum / loss_n if loss_n else None, tokens=int(sums.pop("tokens")),
            bytes_up=int(sums.pop("bytes_up")), bytes_down=int(sums.pop("bytes_down")),
            parameters=int(sums.pop("parameters")), compute_s=compute_s, sync_s=blocked_s + time.monotonic() - t0,
            requests={k: int(v) for k, v in sums.items()},
            takeovers=result.takeovers, incidents=incidents, t=time.time(),
            phases={"compute": compute_s, **result.phases, "outer": outer_s}, hidden_s=hidden_s,
            step=result.round * self.stride, total_steps=self.total_steps, evals=list(evals))
        self._warn_if_alone(info)
        self.metrics.append(info)
        # θ and the momentum stay as they are until the next round's outer step, so their digest
        # (XXH3 over 8 bytes per parameter) and the row's write overlap the next inner steps.
        self._pending_row = self.allreduce.io.pool.submit(self._record, info)
        if local_at_sync is None:
            self._next_phase()
        return info

    def _reset_to_global(self, r: int) -> list[dict[str, Any]]:
        """Round r left this replica's update out for NaN/Inf values: its parameters and its inner
        optimizer's moments are poisoned, and the next round's update would be too. Restart both
        from θ_global — what a relaunch gives — and train on. Returns the incident (lane 0's)."""
        self.view.write(self.state.theta)  # the whole model: every fragment went NaN with it
        if self.inner_opt is not None:
            self.inner_opt.state.clear()  # AdamW's moments and step counts start afresh, lazily
            self.inner_opt.zero_grad(set_to_none=True)
        if self.residual is not None:
            self.residual.zero_()
        rank = self.ctx.rank
        action = (f"rank {rank} reset its model and inner optimizer state to θ_global of round {r} "
                  f"and carries on")
        self._log(f"round {r}: this replica's update was non-finite and left out; {action}")
        if not self.lanes.leader:
            return []
        return [{"round": r, "writer": rank, "replica": rank, "action": action,
                 "problem": "its update held non-finite values (NaN or Inf) and was left out of the round's mean"}]

    def _record(self, info: RoundMetrics) -> None:
        """The replica's row for the round: one per replica (lane 0 writes it), with the digest
        of every lane's state, so a divergence in any lane shows, and every lane's incidents."""
        lanes = self.lanes.exchange({"digest": self.state.digest(), "incidents": info.incidents})
        if self.lanes.leader:
            info.state_digest = "+".join(lane["digest"] for lane in lanes)
            info.incidents = [i for lane in lanes for i in lane["incidents"]]
            self.recorder.write_row(info)
            self.recorder.maybe_summarize(info.round, info.members)

    def _wait_for_record(self) -> None:
        if self._pending_row is not None:
            self._pending_row.result()
            self._pending_row = None

    def _adopted(self, compute_s: float, t0: float, *, next_phase: bool = True) -> RoundMetrics:
        """Took no part in a round: adopted the run's state instead (rejoin or divergence repair)."""
        self.view.write(self.state.theta)
        info = RoundMetrics(round=self.state.round, rank=self.ctx.rank, attempt=self.ctx.attempt, member=False,
                            tokens=self._tokens, compute_s=compute_s, sync_s=time.monotonic() - t0, t=time.time(),
                            phases={"compute": compute_s}, step=self.state.round * self.stride,
                            total_steps=self.total_steps, evals=list(self._evals))
        self.metrics.append(info)
        if next_phase:
            self._next_phase()
        return info

    def _next_phase(self) -> None:
        self.local_steps, self._losses, self._tokens, self._evals = 0, [], 0, []
        self.clock.restart()
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
        self.finish()
        if self._exchanger is not None:
            self._exchanger.shutdown(wait=True)
        self._wait_for_record()
        self.allreduce.close()
        self.lanes.close()

    def __enter__(self) -> DiLoCo:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
