"""A job's time limit inside its partition's maximum (MaxTime): pure functions, table-tested.

A job whose `sbatch --time` is over its partition's MaxTime is refused by sbatch, or (a site without
EnforcePartLimits) stays PENDING forever with Reason=PartitionTimeLimit. So a plan asks for --time
inside the partition's MaxTime, read with `scontrol show partition -o` (`max_time_minutes`; none
where Slurm cannot be asked, e.g. a dry run away from the cluster, and then nothing is checked):

- a `[backend] time_limit` over the maximum is refused in one line: it was asked for as such;
- the time limit derived from the spec's `timeout` (plus the preemption notice and a minute, so
  the replica's own timeout comes first) over it is clamped to the maximum, and the plan says so
  (`note`). Such a job ends at Slurm's limit (TIMEOUT, exit 124): a time limit, relaunched without
  spending the failure budgets, and the replica rejoins from the store.

The same answer says how many nodes one job may have there (`max_nodes`), for replicas of several
nodes (`diloco_slurm.multinode`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from diloco.errors import UserError

UNLIMITED = ("UNLIMITED", "INFINITE")
_FIELD = re.compile(r"(?:^|\s)([A-Za-z]+)=(\S*)")


def parse_minutes(text: str) -> int | None:
    """A Slurm time ("30", "2:00:00", "1-12:00:00", "UNLIMITED") in whole minutes; None for no limit
    or a value this code cannot read."""
    text = text.strip()
    if text.upper() in UNLIMITED or not re.fullmatch(r"(\d+-)?\d+(:\d+){0,2}", text):
        return None
    days, _, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:  # D-H, D-H:M, D-H:M:S
        hours, minutes, seconds = (parts + [0, 0])[:3]
    elif len(parts) == 3:  # H:M:S
        hours, minutes, seconds = parts
    else:  # M, M:S
        hours, (minutes, seconds) = 0, (parts + [0])[:2]
    return (int(days or 0) * 24 + hours) * 60 + minutes + seconds // 60


def _partition_fields(scontrol_partitions: str, partition: str | None) -> dict[str, str] | None:
    """The fields of `partition` (None: the cluster's default one) in `scontrol show partition -o`'s
    output, one partition per line; None when not found."""
    for line in scontrol_partitions.splitlines():
        fields = dict(_FIELD.findall(line))
        if "PartitionName" not in fields:
            continue
        if fields["PartitionName"] == partition or partition is None and fields.get("Default") == "YES":
            return fields
    return None


def max_time_minutes(scontrol_partitions: str, partition: str | None) -> int | None:
    """The MaxTime of `partition` (None: the cluster's default one) in `scontrol show partition -o`'s
    output; None when unlimited or not found."""
    fields = _partition_fields(scontrol_partitions, partition)
    return None if fields is None else parse_minutes(fields.get("MaxTime", "UNLIMITED"))


def max_nodes(scontrol_partitions: str, partition: str | None) -> int | None:
    """The most nodes one job of `partition` may have: its MaxNodes, and never more than it has
    (TotalNodes; a job asking for more is refused, or pends for ever); None when neither is known."""
    fields = _partition_fields(scontrol_partitions, partition) or {}
    known = [int(fields[k]) for k in ("MaxNodes", "TotalNodes") if fields.get(k, "").isdigit()]
    return min(known) if known else None


@dataclass(frozen=True)
class TimeLimit:
    """sbatch --time in minutes, and why it is not what was derived (None: it is)."""

    minutes: int
    note: str | None = None


def time_limit(asked: int | None, timeout: float, notice: int, max_minutes: int | None,
               partition: str | None) -> TimeLimit:
    """--time: `asked` ([backend] time_limit) as given, else long enough that the replica's own
    timeout (exit 124, with a result file) comes before Slurm's notice and kill; inside the
    partition's `max_minutes` as the module's rules say."""
    where = f"partition {partition!r}" if partition else "the cluster's default partition"
    if asked:
        if max_minutes is not None and asked > max_minutes:
            raise UserError(f"[backend] time_limit = {asked} minutes is over the MaxTime of {where} ({max_minutes} "
                            f"minutes): Slurm would never start the jobs; set time_limit to at most {max_minutes}, "
                            f"or drop it (diloco then relaunches each replica at the limit)")
        return TimeLimit(asked)
    derived = max(1, math.ceil((timeout + notice + 60) / 60))
    if max_minutes is not None and derived > max_minutes:
        return TimeLimit(max_minutes, f"--time clamped to {max_minutes} minutes, the MaxTime of {where} (the spec's "
                                      f"timeout of {timeout:g}s asks for {derived}): each replica is relaunched at the "
                                      f"limit (a time limit, not a failure) and rejoins from the store")
    return TimeLimit(derived)
