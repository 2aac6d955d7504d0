"""The DiLoCo API a training function uses.

    diloco = DiLoCo(model, inner_opt, ctx)              # joins the run (or rejoins it)
    for step in diloco.steps(total_steps):              # resumes at the global step
        loss = compute_loss(model, batch(step))
        loss.backward(); inner_opt.step(); inner_opt.zero_grad()
        diloco.step(loss=loss.item(), tokens=n_tokens)  # every H steps: a sync round
        # optional: diloco.report_eval(eval_loss) puts an eval point in the run's metrics

Each round's row (`diloco.store.metrics.RoundMetrics`) says where the replica's time went
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

Where a round runs (docs/sync-modes.md): the training loop only hands the round its fragment of
the model (`transfers`: a reader of the parameters or of a device copy, or a snapshot in a host
buffer for a sync process) and, when the round is done, copies θ_global's fragment back and
merges it on the device. Everything else — store I/O, checksums, decoding,
folding, the outer step, checkpoints and the round's record — is the `exchanger`'s, on a thread
of this process (`exchange = "thread"`, the default) or in a sync process beside it (`exchange =
"process"`, `syncclient`, `syncproc`), which measured slower on an H100 host (bench/gpu_sync.py).

Hiding the sync (docs/sync-modes.md):
- `fragments = K` (Streaming DiLoCo): round r syncs fragment (r − 1) mod K, one round every H/K
  inner steps, so each fragment still syncs every H steps and a round moves 1/K of the model.
- `overlap = true`: a round's exchange runs while inner steps go on; its outer step is merged as
  soon as it has arrived, or exactly `overlap_delay` inner steps after the snapshot (waiting for
  it then if it has not: runs repeat step for step), and at the latest at the next round, which is
  the only other time training waits for the store. The merge keeps the local progress made while
  the round was in flight: the fragment becomes θ_local + (θ_global_new − θ_local_at_sync), so the
  next Δ counts every inner step exactly once. With a delay, a replica's lanes merge at the same
  step too.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from diloco.bootstrap.context import ReplicaContext
from diloco.errors import UserError
from diloco.store.metrics import RoundMetrics
from diloco.inputs.envvars import ENV_SETTINGS, ENV_SYNC_THREADS
from diloco.options import describe_options
from diloco.store.runkeys import RunKeys
from diloco.spec.settings import DilocoSettings

from ..exchange.exchanger import MERGE, RESET, Outcome, Work
from ..transport.faults import Faults
from ..round.lanes import Lanes
from ..outer.manifest import manifest_of
from ..outer.manifest import publish as publish_manifest
from .modelview import model_view
from ..outer.step import blocks_digest
from .roundclock import RoundClock
from ..exchange.syncclient import InThread, SyncProcess
from .transfers import Transfers

# One place for the defaults: the [diloco] table's declaration, DilocoSettings.
DEFAULTS: dict[str, Any] = {o.name: o.default for o in describe_options(DilocoSettings)}


@dataclass
class BackgroundRound:
    """A round being exchanged while inner steps go on (overlap), merged one round late."""

    round: int
    part: int                   # the fragment it updates
    local: torch.Tensor         # the fragment's local parameters when the round began, on the model's device
    blocked_s: float            # time the training loop spent starting it


def inner_optimizer(params, *, lr: float = 4e-4, weight_decay: float = 0.1, betas=(0.9, 0.95)) -> torch.optim.AdamW:
    """The paper's inner optimizer: AdamW lr 4e-4, weight decay 0.1, betas (0.9, 0.95)."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas)


def _process_reachable(store: Any, uri: str | None) -> bool:
    """Whether a sync process could open the run's store itself: a URI, not an object or memory."""
    return store is None and bool(uri) and not str(uri).startswith("memory://")


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
        self.overlap_delay = s.overlap_delay  # None: merged when it arrives
        # time-based rounds: a round closes round_seconds after it began here, or at H steps if sooner
        self.round_seconds = float(s.round_seconds) if s.round_seconds is not None else None
        self.faults = Faults(self.ctx.rank, self.lanes.index, self.ctx.log)  # fault injection; off by default
        self._store = store
        if s.exchange == "process" and _process_reachable(store, self.ctx.rendezvous):  # else: a thread here
            import os

            threads = os.environ.get(ENV_SYNC_THREADS)
            self.sync: SyncProcess | InThread = SyncProcess(self.ctx, s, self.view.total, self.lanes, self._log,
                                                            threads=int(threads) if threads else None)
        else:
            self.sync = InThread(self.ctx, s, store if store is not None else self.ctx.store, self.view.total,
                                 self.lanes, self._log, snapshot=not self.view.reads_live, device=self.view.device)
        self.transfers = Transfers(self.view, self.sync.theta, self.sync.snapshot)
        self.transfers.initial()  # θ_0 from this replica's model, used only if the run is new
        self._round, left = self.sync.join(initial=True)  # the store is verified by now
        try:  # names what the checkpoints hold (`manifest`); another model's replica stops here, every lane
            self.lanes.on_leader(lambda: publish_manifest(self.store, RunKeys(self.ctx.run_id), manifest_of(model),
                                                          total=self.view.total))
        except BaseException:
            self.sync.close()
            raise
        self.view.write(self.sync.theta)
        self._inflight: BackgroundRound | None = None
        self.left = left  # the run was scaled down without this replica: its loop ends (`roster`)
        self.local_steps = 0          # inner steps since the last sync
        self._losses: list[float] = []
        self._tokens = 0
        self._evals: list[list[float]] = []  # [global step, eval loss] reported since the last sync
        self.total_steps: int | None = s.total_steps
        self.clock = RoundClock(self.stride, self.round_seconds, self.lanes)  # when a round is due
        self.metrics: list[RoundMetrics] = []
        self.ctx.global_step = self.global_step

    # -- progress ----------------------------------------------------------------------------

    @property
    def round(self) -> int:
        """Rounds of the global model completed (the one this replica holds)."""
        return self._round

    @property
    def store(self):
        """The run's store (the one given, else the rendezvous): for what a training function writes
        beside the rounds, such as its report (`report.write_run_report`)."""
        return self._store if self._store is not None else self.ctx.store

    @property
    def theta(self) -> torch.Tensor:
        """θ_global of this process's lane: fp32 on the host, the same bytes on every replica."""
        return self.sync.theta

    def theta_digest(self) -> str:
        """A digest of θ_global, the same on every replica whatever its number of processes (XXH3
        per block of the model, summed: `outer.state_digest`). Every process of a replica calls it:
        they add up their parts."""
        if self.lanes.count > 1 and self.lanes.group is None:
            raise RuntimeError("DiLoCo.theta_digest() adds up the replica's processes' parts: call it before close()")
        part = blocks_digest(self.sync.theta, self.view.start)
        return f"{sum(self.lanes.exchange(part)) % (1 << 64):016x}"

    @property
    def in_flight(self) -> bool:
        """Whether a round is being exchanged while inner steps go on (overlap, not merged yet)."""
        return self._inflight is not None

    @property
    def global_step(self) -> int:
        started = self._inflight.round if self._inflight is not None else self._round
        return started * self.stride + self.local_steps

    def steps(self, total_steps: int | None = None) -> Iterator[int]:
        """Global step indices still to do; a rejoining replica starts where the run is.

        `total_steps` defaults to the spec's [diloco] total_steps; the rows carry it, so the
        launcher's progress shows step / total and an ETA. The loop is `begin`, one `step()` per
        inner step while the run has steps left for this replica, then `end` (a loop diloco does
        not drive, such as a Trainer's, calls the three itself: `integrations`).
        """
        total = self.begin(total_steps)
        while self.global_step < total and not self.left:
            yield self.global_step
        self.end()

    def begin(self, total_steps: int | None = None) -> int:
        """Fix the run's length (default: [diloco] total_steps) before the first inner step; the
        length, checked against the settings."""
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
        return self.total_steps

    def end(self) -> None:
        """After the last inner step: the round still in flight (overlap) is merged and the model
        is set to θ_global, the state every replica agrees on, so what training code evaluates
        or saves afterwards is the global model on every replica. (Inner steps after the last
        round, and with fragments the other fragments' steps since their last round, are not in
        it.)"""
        self.finish()
        # the last round's record (it shares the lanes' group with the write below) and, when the
        # run's training is done (a replica scaled away in its last round included: it may own
        # shards of it; not one scaled away before), that round checkpointed: the store holds the
        # final model (`diloco export`)
        if self.total_steps is not None and self.global_step >= self.total_steps:
            self.sync.checkpoint_last()
        else:
            self.sync.settle()
        self.view.write(self.sync.theta)

    def step(self, loss: float | None = None, tokens: int = 0) -> RoundMetrics | None:
        """Call after each inner optimizer step; a round every sync_every/fragments steps (with
        round_seconds: at the round's deadline, or after sync_every steps).

        Returns the metrics row of a round when its outer step has been applied here. A
        non-finite `loss` is left out of the row's mean loss (rows are JSON, which has no NaN); a
        diverged replica shows as an incident when its update is left out, and resets.
        """
        self.faults.after_step(self.global_step, self.view)
        self.local_steps += 1
        if loss is not None and math.isfinite(loss):  # a diverged step is an incident, not a NaN in JSON rows
            self._losses.append(float(loss))
        self._tokens += int(tokens)
        self.sync.check()  # a sync process that died between rounds fails the replica now
        if self.clock.due(self.local_steps):
            info = self.sync_round()
        elif self._inflight is not None and self._merge_now():
            info = self._merge()
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

    def sync_round(self) -> RoundMetrics | None:
        """Start the next round: wait for it here, or (overlap) let it run while inner steps go on.

        Returns the row of the round applied during this call: this round's, or with overlap
        the previous round's if it had not been merged yet (None if there was none).
        """
        compute_s = time.monotonic() - self.clock.phase_start
        merged = self._merge() if self._inflight is not None else None  # the one wait overlap has: a round late
        if self.left:  # that round was this replica's last
            return merged
        t0 = time.monotonic()  # (the merge's wait is in the merged round's row)
        r = self._round + 1
        part = (r - 1) % self.fragments
        work = Work(steps=self.local_steps, tokens=self._tokens, loss_sum=sum(self._losses),
                    loss_n=len(self._losses), evals=self._evals, compute_s=compute_s, total_steps=self.total_steps,
                    started=t0)
        local, reader = self.transfers.snapshot(part, self.fragments, keep=self.overlap)
        self.sync.start(r, work, reader)
        if self.overlap:  # training goes on during the exchange; `local` is kept for the merge
            self._inflight = BackgroundRound(r, part, local, time.monotonic() - t0)
            self._next_phase()
            return merged
        outcome = self.sync.outcome()
        return self._apply(outcome, None, t0, blocked_s=0.0, handed_over=outcome.ended)

    def _merge_now(self) -> bool:
        """Whether the round in flight is merged after this step: `overlap_delay` steps after its
        snapshot; without a delay, once it has arrived (a replica of several processes merges at
        the next round instead, where its lanes meet)."""
        if self.overlap_delay is not None:
            return self.local_steps >= self.overlap_delay
        return self.lanes.count == 1 and self.sync.arrived()

    def _merge(self) -> RoundMetrics:
        """Wait for the round in flight (if it has not arrived yet) and apply it."""
        flight, self._inflight = self._inflight, None
        t0 = time.monotonic()
        outcome = self.sync.outcome()
        waited = time.monotonic() - t0
        return self._apply(outcome, flight.local, t0, blocked_s=flight.blocked_s,
                           hidden_s=max(0.0, outcome.exchange_s - waited), next_phase=False)

    def _apply(self, outcome: Outcome, local_at_sync: torch.Tensor | None, t0: float, *, blocked_s: float,
               hidden_s: float = 0.0, next_phase: bool = True, handed_over: float | None = None) -> RoundMetrics:
        """Put the round's outcome into the model (on its device); the round's row.

        A round the training process waited for counts its outer phase from `handed_over`, where
        the exchange's phases ended, so that the result's way back (a thread waking, a pipe from
        the sync process) is in it and the phases add up to the round's compute and sync time."""
        self.faults.phase("outer", outcome.round)
        outer_t0 = time.monotonic()
        self._round = outcome.round
        self.left = self.left or outcome.leave
        if outcome.action == MERGE:
            self.transfers.merge(outcome.part, self.fragments, local_at_sync)
        else:  # the whole global model: caught up, rejoined, repaired, or reset after a non-finite update
            self.view.write(self.sync.theta)
            if outcome.action == RESET and self.inner_opt is not None:
                self.inner_opt.state.clear()  # AdamW's moments and step counts start afresh, lazily
                self.inner_opt.zero_grad(set_to_none=True)
        now = time.monotonic()
        outer_s = now - (outer_t0 if handed_over is None else min(handed_over, outer_t0))
        row = outcome.row
        row.sync_s, row.hidden_s, row.t = blocked_s + now - t0, hidden_s, time.time()
        outer_s += row.phases.get("outer", 0.0)  # the exchange's end of the outer step, then the copy into the model
        if len(row.phases) > 1:  # a round it took part in (a rejoin's row has its compute phase only)
            row.phases["outer"] = outer_s
        self.sync.applied(row.round, sync_s=row.sync_s, outer_s=outer_s, hidden_s=hidden_s)
        self.metrics.append(row)
        if next_phase:
            self._next_phase()
        return row

    def _next_phase(self) -> None:
        self.local_steps, self._losses, self._tokens, self._evals = 0, [], 0, []
        self.clock.restart()
        self.faults.phase("compute", self._round + 1)

    def _log(self, msg: str) -> None:
        self.ctx.log.info(msg)

    def close(self) -> None:
        try:
            self.finish()
        finally:
            self.sync.close()
            self.lanes.close()

    def __enter__(self) -> DiLoCo:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
