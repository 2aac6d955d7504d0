"""The `[diloco]` settings as one frozen type, validated once from the spec's schema.

The schema (`diloco.schema.DILOCO`: types, bounds, choices, defaults) is the one place each
setting is defined. The launcher validates the spec's table into `DilocoSettings`, hands it to
every replica as one environment variable (`to_env`, DILOCO_SETTINGS), and the replica reads it
back with `from_env`, which runs the same checks: a replica trusts no setting that arrives.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from .errors import SpecError
from .schema import DILOCO, check_table


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


@dataclass(frozen=True)
class DilocoSettings:
    sync_every: int
    outer_lr: float
    outer_momentum: float
    nesterov: bool
    transport: str
    topk_density: float
    fragments: int
    overlap: bool
    round_seconds: float | None
    total_steps: int | None
    parameters: int | None
    round_timeout: float
    min_members: int
    checkpoint_every: int
    poll_interval: float | None
    poll_max: float | None

    @classmethod
    def from_table(cls, table: Mapping[str, Any], *, where: str = "<spec>") -> DilocoSettings:
        """Checked against the schema (unknown keys, types, bounds, choices), defaults filled in."""

        values = check_table(where, {k: v for k, v in table.items() if v is not None}, DILOCO, "diloco.")
        if values["sync_every"] % values["fragments"]:
            raise SpecError(f"{where}: `diloco.fragments` ({values['fragments']}) must divide `diloco.sync_every` "
                            f"({values['sync_every']}): one fragment syncs every sync_every/fragments inner steps")
        if values.get("round_seconds") is not None:
            check_time_based(values, where)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_env(self) -> str:
        """DILOCO_SETTINGS's value: how the launcher hands the settings to every replica."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_env(cls, text: str | None, **overrides: Any) -> DilocoSettings:
        """What a replica runs with: DILOCO_SETTINGS, checked again, with keyword overrides on top."""
        from .envvars import ENV_SETTINGS

        try:
            table = json.loads(text) if text else {}
        except ValueError:
            raise SpecError(f"{ENV_SETTINGS} is not JSON; it is written by the launcher (diloco run)") from None
        if not isinstance(table, dict):
            raise SpecError(f"{ENV_SETTINGS} must be a JSON object of [diloco] settings")
        return cls.from_table({**table, **{k: v for k, v in overrides.items() if v is not None}},
                              where=ENV_SETTINGS)
