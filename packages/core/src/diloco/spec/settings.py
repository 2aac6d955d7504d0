"""The `[diloco]` and `[restart]` settings as frozen types: each setting declared once, here.

The fields of `DilocoSettings` and `RestartSettings` (types, bounds, choices, defaults, help) are
the one place each setting is defined: the spec's tables are checked against them
(`diloco.options.check_table`), and the replica's defaults and the listings read them
(`describe_options`). The launcher validates the spec's table into `DilocoSettings`, hands it to
every replica as one environment variable (`to_env`, DILOCO_SETTINGS), and the replica reads it
back with `from_env`, which runs the same checks: a replica trusts no setting that arrives.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import SpecError
from ..options import check_table, option
from ..store.wiresize import CODECS


def check_time_based(values: Mapping[str, Any], where: str) -> None:
    """What `round_seconds` (time-based rounds) cannot combine with, refused in one line."""
    if values["fragments"] > 1 or values["overlap"]:
        which = "fragments > 1" if values["fragments"] > 1 else "overlap = true"
        raise SpecError(f"{where}: `diloco.round_seconds` does not combine with `{which}` yet (a round's length "
                        f"is set by the clock, a fragment's or an overlapped round's by steps); drop one of them")
    if values["transport"] == "topk":
        raise SpecError(f"{where}: `diloco.round_seconds` does not combine with transport \"topk\" yet (its residual "
                        f"carries unsent values of rounds with other step counts); use int4 or int8 to cut bytes")
    total, H = values.get("total_steps"), values["sync_every"]
    if total is not None and total % H:
        raise SpecError(f"{where}: with `diloco.round_seconds`, `diloco.total_steps` ({total}) must be a multiple of "
                        f"`diloco.sync_every` ({H}): a round counts as sync_every steps, and a run must end on a "
                        f"round boundary or its replicas end on different models")


def check_overlap(values: Mapping[str, Any], where: str) -> None:
    """`overlap_delay` needs `overlap = true`, and must fit between two rounds."""
    delay = values.get("overlap_delay")
    if delay is not None and not values["overlap"]:
        raise SpecError(f"{where}: `diloco.overlap_delay` applies to overlapped rounds only; set `diloco.overlap = "
                        f"true` or drop it")
    stride = values["sync_every"] // values["fragments"]
    if delay is not None and delay > stride:
        raise SpecError(f"{where}: `diloco.overlap_delay` ({delay}) is past the next round, which starts "
                        f"sync_every/fragments = {stride} inner steps after a snapshot; use at most {stride}")


@dataclass(frozen=True)
class DilocoSettings:
    """The `[diloco]` table, read by every replica (`diloco_replica.DiLoCo`)."""

    sync_every: int = option(50, help="H: inner steps between syncs", min=1, max=1_000_000)
    outer_lr: float = option(0.7, help="the outer optimizer's learning rate", min=0, max=100)
    outer_momentum: float = option(0.9, help="the outer optimizer's momentum", min=0, max=1)
    nesterov: bool = option(True, help="Nesterov momentum in the outer step")
    transport: str = option("fp32", help="the codec on the wire; accumulation is always fp32 (docs/sync-modes.md)",
                            choices=CODECS)
    error_feedback: bool = option(True, help="lossy transports (bf16, fp16, int8, int4): what rounding dropped from a "
                                             "round's Δ is added to the next one's (topk always does this)")
    topk_density: float = option(0.01, help="transport topk: the fraction of each 4,096-element block sent",
                                 min=0.0001, max=1)
    fragments: int = option(1, help="K: the model syncs in K staggered fragments, one every sync_every/K steps",
                            min=1, max=1024)
    overlap: bool = option(False, help="exchange a round in the background while inner steps go on; its outer step "
                                       "is merged into the model when it arrives (docs/sync-modes.md)")
    overlap_delay: int | None = option(
        None, help="overlap: merge a round's outer step exactly this many inner steps after its snapshot, waiting "
                   "for it if it has not arrived, so runs repeat step for step (default: when it arrives)",
        min=1, max=1_000_000)
    codec_device: str = option(
        "host", help="where a quantised transport's arithmetic runs (error feedback, decoding, the fold, the "
                     "mean's encoding): \"host\" (its cores) or \"model\" (the model's GPU when it has one and the "
                     "round runs on a thread of its process; not yet measured on a GPU); docs/sync-modes.md",
        choices=("host", "model"))
    exchange: str = option("thread", help="where a round's store I/O and outer step run: \"thread\" (a thread of the "
                                          "training process) or \"process\" (a sync process beside it); "
                                          "docs/sync-modes.md", choices=("thread", "process"))
    round_seconds: float | None = option(
        None, help="time-based rounds: each replica runs inner steps for this long a round (at most sync_every of "
                   "them), and the mean normalises each update by its steps (docs/sync-modes.md)", min=0.01, max=86_400)
    total_steps: int | None = option(None, help="inner steps per replica for the whole run: DiLoCo.steps() runs this "
                                                "many, and the estimate and the ETA count on it", min=1, max=10**12)
    parameters: int | None = option(None, help="the model's parameter count, for the estimate before launch (without "
                                               "it the replica measures it at round 1)", min=1, max=10**14)
    part_mb: float = option(32.0, help="a round's shards are sent as objects of at most this many MiB of fp32, so "
                                       "folding, uploading and downloading pipeline (docs/sync-modes.md)",
                            min=0.001, max=65_536)
    round_timeout: float = option(300.0, help="seconds a sync round waits for min_members replicas; past it the "
                                             "round fails", min=0.1, max=86_400)
    round_grace: float | None = option(
        None, help="seconds a ready replica waits for expected replicas that are not ready before the round goes "
                   "on without them (default: one recent round period, at least 5; docs/design.md 'Who a round "
                   "waits for')", min=0, max=86_400)
    min_members: int = option(1, help="fewest replicas a sync round may average over", min=1, max=4096)
    store_outage_limit: float = option(
        900.0, help="seconds replicas and the launcher wait for a store that does not answer (connection refused, "
                    "timeouts, 5xx) before the run fails naming it; rounds' timeouts stand still meanwhile",
        min=0, max=7 * 86_400)
    checkpoint_every: int = option(10, help="rounds between checkpoints of the global state", min=1, max=1_000_000)
    poll_interval: float | None = option(None, help="first wait when polling the store (default: by store)",
                                         min=0.001, max=60)
    poll_max: float | None = option(None, help="longest wait between polls (default: by store)", min=0.001, max=3600)

    @classmethod
    def from_table(cls, table: Mapping[str, Any], *, where: str = "<spec>") -> DilocoSettings:
        """Checked against the declaration (unknown keys, types, bounds, choices), defaults filled in."""
        values = check_table(where, {k: v for k, v in table.items() if v is not None}, cls, prefix="diloco.")
        if values["sync_every"] % values["fragments"]:
            raise SpecError(f"{where}: `diloco.fragments` ({values['fragments']}) must divide `diloco.sync_every` "
                            f"({values['sync_every']}): one fragment syncs every sync_every/fragments inner steps")
        if values.get("round_seconds") is not None:
            check_time_based(values, where)
        check_overlap(values, where)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_env(self) -> str:
        """DILOCO_SETTINGS's value: how the launcher hands the settings to every replica."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_env(cls, text: str | None, **overrides: Any) -> DilocoSettings:
        """What a replica runs with: DILOCO_SETTINGS, checked again, with keyword overrides on top."""
        from ..inputs.envvars import ENV_SETTINGS

        try:
            table = json.loads(text) if text else {}
        except ValueError:
            raise SpecError(f"{ENV_SETTINGS} is not JSON; it is written by the launcher (diloco run)") from None
        if not isinstance(table, dict):
            raise SpecError(f"{ENV_SETTINGS} must be a JSON object of [diloco] settings")
        return cls.from_table({**table, **{k: v for k, v in overrides.items() if v is not None}},
                              where=ENV_SETTINGS)


@dataclass(frozen=True)
class RestartSettings:
    """The `[restart]` table, read by the supervisor; the rules are `diloco.supervise.policy`'s."""

    policy: str = option("per-rank", help="what a failure relaunches: one rank, every rank, or none",
                         choices=("per-rank", "gang", "never"))
    max_restarts: int = option(10, help="relaunches allowed across the whole run", min=0, max=100_000)
    max_restarts_per_rank: int = option(3, help="relaunches allowed of each rank", min=0, max=10_000)
    backoff: float = option(1.0, help="seconds before a rank's first relaunch, doubled after each", min=0, max=3600)
    backoff_max: float = option(60.0, help="the longest wait before a relaunch", min=0, max=86_400)
    min_replicas: int | None = option(None, help="ranks that must stay alive and succeed (default: all)",
                                      min=1, max=4096)
    monitor_interval: float = option(1.0, help="seconds between the supervisor's looks at the replicas",
                                     min=0.01, max=3600)
    max_preemptions: int = option(50, help="relaunches after the platform took a replica's machine away (exit 75)",
                                  min=0, max=100_000)
    max_time_limits_per_rank: int = option(1000, help="relaunches of each rank after it reached a time limit (the "
                                                      "spec's timeout or the platform's, exit 124)",
                                           min=0, max=1_000_000)
    fail_fast_seconds: float = option(900.0, help="the same error at the same step on every rank this soon after "
                                                  "start: stop", min=0, max=7 * 86_400)

    @classmethod
    def from_table(cls, table: Mapping[str, Any], n_replicas: int, *,
                   relaunches_one_rank: bool = True) -> RestartSettings:
        values = check_table("[restart]", {k: v for k, v in table.items() if v is not None}, cls, prefix="restart.")
        values["min_replicas"] = values["min_replicas"] or n_replicas
        if values["policy"] == "per-rank" and not relaunches_one_rank:
            values["policy"] = "gang"  # the backend cannot start one rank alone
        return cls(**values)

    def backoff_after(self, restarts: int) -> float:
        return min(self.backoff * (2 ** restarts), self.backoff_max)
