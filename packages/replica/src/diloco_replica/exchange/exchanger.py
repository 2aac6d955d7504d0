"""The store side of one replica's (one lane's) rounds: everything a round does except touch the model.

`Exchanger` owns the store all-reduce, θ_global with the outer momentum (`globalstate`), the
checkpoints, the round's record (`rows`) and topk's residual. It never sees the model: the training
process hands it the lane's local parameters of the round's fragment, as a flat fp32 host vector (a
snapshot: the sync process's shared buffer, an FSDP2 lane's) or as a reader it calls for a slice at
a time (`streaming.LiveDelta`: on a thread of the training process, which holds no snapshot), and
it answers with an `Outcome` that says what the training process must copy from θ_global into the
model. That is what lets it run in a process of its own (`syncproc`): store I/O, checksums,
decoding, folding and the outer step never compete with the training loop for its interpreter.

A round here: wait until the previous round's record is written (its digest is of the state
before this outer step); reload if the run's summaries say this replica's state diverged; Δ =
θ_global − θ_local (over the snapshot, or computed per slice as the all-reduce reads it); the all-reduce, whose means go to the outer step
shard by shard as they arrive (`streaming`), checkpointed when due. The row is finished with the
training loop's own timings (`applied`) and written in the background, overlapping the next
inner steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from diloco.bootstrap.context import ReplicaContext
from diloco.store.metrics import RoundMetrics
from diloco.store.presence import Presence
from diloco.spec.settings import DilocoSettings
from diloco.store.objectstore import poll_defaults, verify_store

from ..round.allreduce import RoundResult, StoreAllReduce
from ..transport.codecdevice import CodecDevice
from ..round.steps.feedback import LOSSY, quantise_pieces_with_feedback, quantise_with_feedback
from ..outer.globalstate import GlobalState
from ..round.laps import Laps
from ..round.lanes import Lanes
from ..records.rows import RoundRows
from ..round.errors import FellBehind
from ..round.streaming import LiveDelta, LocalReader


@dataclass
class Work:
    """What the training loop did in the phase a round closes (sent with the round)."""

    steps: int
    tokens: int = 0
    loss_sum: float = 0.0
    loss_n: int = 0
    evals: list[list[float]] = field(default_factory=list)
    compute_s: float = 0.0
    total_steps: int | None = None  # the run's length as the training loop knows it (`DiLoCo.steps`)
    started: float | None = None  # time.monotonic() when the training loop began the round: its phases start there


# What the training process copies into the model once a round is done.
MERGE = "merge"        # the round's fragment of θ_global (with overlap: on top of the progress made since)
WHOLE = "whole"        # all of θ_global: not a member (caught up), or rejoined / repaired from a checkpoint
RESET = "reset"        # all of θ_global, and the inner optimizer's state cleared: its update was non-finite


@dataclass
class Outcome:
    round: int                  # the round the global state is at now
    action: str                 # MERGE, WHOLE or RESET
    part: int                   # the fragment round `round` updated (MERGE)
    row: RoundMetrics
    exchange_s: float = 0.0     # seconds the exchange took here
    ended: float | None = None  # the instant (CLOCK_MONOTONIC) its phases end; the handoff counts from there
    leave: bool = False         # the next round's roster drops this replica (the run shrank): it stops


class Exchanger:
    def __init__(self, ctx: ReplicaContext, settings: DilocoSettings, store: Any, total: int, lanes: Lanes, *,
                 log: Callable[[str], None], theta_out: torch.Tensor | None = None,
                 device: torch.device | None = None):
        """`device`: the model's, where the round runs in its training process (None in a sync
        process): the quantised transports' arithmetic runs there (`codecdevice`)."""
        s = settings
        self.ctx, self.settings, self.lanes, self.log = ctx, s, lanes, log
        self.H, self.fragments = int(s.sync_every), int(s.fragments)
        self.stride = self.H // self.fragments
        verify_store(store, ctx.run_id, f"rank-{ctx.rank}-{ctx.lane}-attempt-{ctx.attempt}")
        first, cap = poll_defaults(store.uri)
        self.codec_device = CodecDevice.choose(s.codec_device, device, s.transport)
        self.allreduce = StoreAllReduce(
            store, ctx.run_id, ctx.rank, ctx.world_size, codec=s.transport,
            round_timeout=float(s.round_timeout), min_members=int(s.min_members),
            poll_interval=float(s.poll_interval or first), poll_max=float(s.poll_max or cap), log=log,
            lanes=lanes, topk_density=float(s.topk_density),
            step_cap=self.H if s.round_seconds is not None else None, part_mb=float(s.part_mb),
            round_grace=s.round_grace, incarnation=ctx.incarnation, codec_device=self.codec_device)
        self.state = GlobalState(self.allreduce, total, lr=float(s.outer_lr), momentum=float(s.outer_momentum),
                                 nesterov=bool(s.nesterov), checkpoint_every=int(s.checkpoint_every), log=log,
                                 fragments=self.fragments, theta_out=theta_out)
        # error feedback (topk's, or the quantised transports' `feedback`): what this lane has not
        # sent yet. A (re)joining replica starts at zero.
        # (not with time-based rounds: a residual carried into a round of other step counts would be
        # normalised by the wrong τ, as `settings.check_time_based` says of topk)
        self.feedback = s.transport in LOSSY and bool(s.error_feedback) and s.round_seconds is None
        numel = self.state.numel  # this lane's slice of the model (`layout.lane_range`)
        # (on the model's GPU where the codec's arithmetic runs there: `codecdevice`)
        self.residual = self.codec_device.zeros(numel) if s.transport == "topk" or self.feedback else None
        self.rows = RoundRows(ctx, lanes, self.state, self.allreduce, log=log)
        self.numel = numel
        self.total_steps: int | None = s.total_steps

    def join(self, initial: Callable[[], torch.Tensor] | None) -> tuple[int, bool]:
        """Adopt the run's global state (`initial()`: θ_0 from the model, read only if the run is new)
        and wait for the round this replica takes part in (`take_part`), then write this replica's
        row of the round it starts from (`RoundRows.record_held`). Returns the state's round, and
        whether this replica is to leave instead (scaled away before it got in: no row then)."""
        self.state.bootstrap(initial)
        c, left = self.take_part()
        if not left:
            self.rows.record_held(self.stride, self.total_steps)
        return c, left

    def take_part(self) -> tuple[int, bool]:
        """Start at a round boundary, as the others do (`diloco.store.presence`): a replica that holds
        the state of round c without having been a member of it (relaunched, rejoined from a
        checkpoint, left out of a round it was late for, added by `diloco scale`) announces the
        round it takes part in, and follows the rounds until the one before is decided. That is
        round c + 1 when nobody else trains it (the run's start, a gang restart), else c + 2: the
        others are into round c + 1 already, and a replica that started it late would be late
        for every round after it. No round waits for a replica until it has announced itself.
        Returns the state's round and whether the run was scaled down without this replica."""
        ar, lanes = self.allreduce, self.lanes
        announced: int | None = None
        since = ar.io.clock()
        while True:
            c = self.state.round
            if self.total_steps is not None and c * self.stride >= self.total_steps:
                return c, False  # the run is over: nothing to join
            if announced is not None and c >= announced:  # missed it: the run went on without this replica
                announced, since = None, ar.io.clock()
            rank_in = self.ctx.rank in ar.roster(c + 1)
            if announced is not None and c == announced - 1 and rank_in:
                return c, False
            stuck = ar.io.clock() - since > ar.io.round_timeout
            where = lanes.on_leader(lambda: self._where(c, announced, stuck=stuck))
            if where == "out":
                self.log("the run was scaled down without this replica before it joined; it leaves")
                return c, True
            if where == "go":
                return c, False
            if isinstance(where, int) and where != announced:
                announced = where
                self.log(f"holding round {c}; waiting for " + (f"round {where - 1} to end: it takes part from round "
                         f"{where}" if rank_in else "a round to admit this replica"))
            time.sleep(ar.io.poll_max)
            self._catch_up()

    def _where(self, c: int, announced: int | None, *, stuck: bool) -> str | int:
        """(Lane 0) "go": take part in round c + 1 now; "out": scaled away; else the round this
        replica has announced it takes part from (announced here if it had not been)."""
        ar, rank, incarnation = self.allreduce, self.ctx.rank, self.ctx.incarnation
        rosters = ar.membership.rosters
        if rank not in ar.roster(c + 1):  # added by `diloco scale`: a round's decision lets it in
            target = rosters.look()[0]
            if target is not None and rank not in target.ranks:
                return "out"
            if announced is None:
                rosters.announce(rank, c + 2, incarnation)
            return announced or c + 2
        if c == 0 and incarnation == 0:  # the run's start: every rank of the launch is expected in round 1
            return "go"
        if c > 0 and rank not in ar.roster(c):  # round c's decision let it in: round c + 1 expects it
            return "go"
        if announced is not None and not stuck:
            return announced
        presence = rosters.look()[1]
        if stuck or not self._others_train(c, presence):
            rosters.announce(rank, c + 1, incarnation)
            return "go"
        rosters.announce(rank, c + 2, incarnation)
        return c + 2

    def _others_train(self, c: int, presence: Presence) -> bool:
        """Whether another replica has been training round c + 1 since round c closed: a member of
        round c the launcher has not seen end, that is neither waiting for a later round nor itself
        starting round c + 1 just now (a replica that announced c + 1: after a gang restart every
        replica loads the state at once, and they all take round c + 1 together)."""
        ar, rank = self.allreduce, self.ctx.rank
        decided = ar.membership.read(c) if c > 0 else None
        before = decided.members if decided is not None else ar.roster(c + 1)
        for k in ar.roster(c + 1):
            if k == rank or k not in before or presence.is_away(k):
                continue
            if not presence.waits_for_later(k, c + 1) and not presence.announced(k, c + 1):
                return True
        return False

    def leaving(self) -> bool:
        """Whether the roster of the round after the state's drops this replica (the run shrank)."""
        leave = self.ctx.rank not in self.allreduce.roster(self.state.round + 1)
        if leave:
            self.log(f"round {self.state.round}: the run was scaled down without this replica; it leaves")
        return leave

    # -- a round -----------------------------------------------------------------------------

    def run(self, r: int, local: torch.Tensor | LocalReader, work: Work) -> Outcome:
        """Round r from `local`: a snapshot of the lane's local parameters (the round's fragment of
        it is read, then overwritten with Δ), or a reader of the round's fragment of them."""
        t0 = time.monotonic()
        laps = Laps(work.started)  # settling, the divergence check and Δ are the upload's preparation
        self.settle()
        if work.total_steps is not None:
            self.total_steps = work.total_steps
        if r != self.state.round + 1:
            raise ValueError(f"round {r} asked for while the global state is at round {self.state.round}")
        since = self.state.round - 1
        diverged = self.lanes.on_leader(lambda: self.rows.recorder.diverged_since(since)) if self.state.round > 0 else None
        if diverged is not None:
            self.log(f"this replica's global state diverged from the majority's at round {diverged}; "
                     f"reloading it from an older checkpoint")
            self.state.repair_divergence(diverged, None)
            self.rows.recorder.skip_through(self.state.round)  # later summaries still show the old state
            self.take_part()
            return self._adopted(work, t0)
        a, b = self.state.bounds(r)
        cut = self.state.cut(r)
        delta: torch.Tensor | LiveDelta
        if isinstance(local, torch.Tensor):
            delta = local[a:b]
            torch.sub(self.state.theta[a:b], delta, out=delta)  # Δ = θ_global − θ_local
        else:
            delta = LiveDelta(self.state.theta[a:b], local)
        residual = self.residual[a:b] if self.residual is not None else None
        encoded = {}
        if self.feedback:  # quantised here, piece by piece as the all-reduce cuts the round
            pieces, uploaded = self.allreduce.upload_layout(r, cut)
            with self.codec_device.running():
                if isinstance(delta, LiveDelta):
                    encoded = quantise_pieces_with_feedback(delta, residual, self.settings.transport, pieces)
                else:
                    encoded = quantise_with_feedback(delta, residual, self.settings.transport, pieces, keep=uploaded)
            residual = None
        self.state.begin(r)
        try:
            result = self.lanes.agree(lambda: self.allreduce.run_round(
                r, delta, cut=cut, in_place=True, residual=residual, sink=self.state.sink(r), encoded=encoded,
                steps=work.steps if self.settings.round_seconds is not None else None, laps=laps))
        except FellBehind as exc:
            self._rejoin(exc)
            self.take_part()
            return self._adopted(work, t0)
        return self._finished(result, work, t0, laps)

    def _catch_up(self) -> None:
        """Adopt every round completed since the state's. A round collected under the replay (the
        run went past the store's retained history while this replica was held, paused or slow,
        as a straggler left out of a round can be) is no failure of the replica: it rejoins from
        the newest checkpoint, as one that fell behind inside a round does."""
        try:
            self.state.catch_up()
        except FellBehind as exc:
            self._rejoin(exc)

    def _rejoin(self, exc: FellBehind) -> None:
        self.log(f"{exc}; rejoining from the latest checkpoint")
        self.state.bootstrap(None)

    def _finished(self, result: RoundResult, work: Work, t0: float, laps: Laps) -> Outcome:
        self.state.finish(result.round, result.members)  # the outer step went in shard by shard
        # the replica's row: every lane's bytes, requests and tokens; the mean loss over its processes;
        # and whether any lane's update was left out for NaN/Inf (then every lane resets)
        sums = self.lanes.total({"bytes_up": result.traffic.bytes_up, "bytes_down": result.traffic.bytes_down,
                                 **result.traffic.requests(), "tokens": work.tokens,
                                 "loss_sum": work.loss_sum, "loss_n": work.loss_n, "parameters": self.numel,
                                 "nonfinite": int(self.ctx.rank in result.nonfinite)})
        left_out_nonfinite = sums.pop("nonfinite") > 0
        incidents = result.incidents + self.allreduce.io.take_found()  # + any met rejoining since the last row
        action = MERGE
        if not result.member:
            self._catch_up()  # others may be rounds ahead: adopt every completed round
            self.take_part()  # and start the next round this replica takes part in with the others
            incidents += self.allreduce.io.take_found()
            action = WHOLE  # and the whole global model goes into the model, as a rejoining replica does
        elif left_out_nonfinite:
            incidents += self._reset(result.round)
            action = RESET
        loss_sum, loss_n = sums.pop("loss_sum"), sums.pop("loss_n")
        # A non-member's row is of the round whose state it holds now, after catching up and waiting
        # for its next round: its state digest is of that round, and the summary compares it there.
        r = result.round if result.member else self.state.round
        members = result.members
        if r != result.round:
            decided = self.allreduce.membership.read(r)
            members = decided.members if decided is not None else members
        leave = self.leaving()
        laps.lap("outer")  # the rest of the outer step and the round's record (the model's copy: the caller's)
        row = RoundMetrics(
            round=r, rank=self.ctx.rank, attempt=self.ctx.attempt, members=members,
            member=result.member, loss=loss_sum / loss_n if loss_n else None, tokens=int(sums.pop("tokens")),
            bytes_up=int(sums.pop("bytes_up")), bytes_down=int(sums.pop("bytes_down")),
            parameters=int(sums.pop("parameters")), compute_s=work.compute_s,
            requests={k: int(v) for k, v in sums.items()}, takeovers=result.takeovers, incidents=incidents,
            phases={"compute": work.compute_s, **result.phases, "outer": laps.seconds["outer"]}, step=r * self.stride,
            total_steps=self.total_steps, evals=list(work.evals))
        self.rows.keep(row)
        return Outcome(self.state.round, action, self.state.fragment(result.round), row,
                       exchange_s=time.monotonic() - t0, ended=laps.at, leave=leave)

    def _adopted(self, work: Work, t0: float) -> Outcome:
        """Took no part in a round: adopted the run's state instead (rejoin or divergence repair)."""
        row = RoundMetrics(round=self.state.round, rank=self.ctx.rank, attempt=self.ctx.attempt, member=False,
                           tokens=work.tokens, compute_s=work.compute_s, phases={"compute": work.compute_s},
                           step=self.state.round * self.stride, total_steps=self.total_steps, evals=list(work.evals))
        return Outcome(self.state.round, WHOLE, 0, row, exchange_s=time.monotonic() - t0, leave=self.leaving())

    def _reset(self, r: int) -> list[dict[str, Any]]:
        """Round r left this replica's update out for NaN/Inf values: its residual restarts at zero
        (the training process restarts the model and the inner optimizer). Returns the incident."""
        if self.residual is not None:
            with self.codec_device.running():
                self.residual.zero_()
        rank = self.ctx.rank
        action = f"rank {rank} reset its model and inner optimizer state to θ_global of round {r} and carries on"
        self.log(f"round {r}: this replica's update was non-finite and left out; {action}")
        if not self.lanes.leader:
            return []
        return [{"round": r, "writer": rank, "replica": rank, "action": action,
                 "problem": "its update held non-finite values (NaN or Inf) and was left out of the round's mean"}]

    # -- the record --------------------------------------------------------------------------

    def applied(self, r: int, *, sync_s: float, outer_s: float, hidden_s: float) -> None:
        """The training process put round r into the model: its row is finished and written
        (`RoundRows.applied`)."""
        self.rows.applied(r, sync_s=sync_s, outer_s=outer_s, hidden_s=hidden_s)

    def settle(self) -> None:
        """Wait for the last round's record (`RoundRows.settle`)."""
        self.rows.settle()

    def checkpoint_last(self) -> None:
        """Training is over: the last round's record written, that round checkpointed
        (`GlobalState.checkpoint_last`)."""
        self.settle()
        self.state.checkpoint_last()

    def close(self) -> None:
        self.rows.close()
        self.allreduce.close()
