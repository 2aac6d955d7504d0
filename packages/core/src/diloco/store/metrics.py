"""Round metrics: one type for a replica's row, one for a round's summary, and a reader that
costs O(new rounds) requests.

Each replica writes one `RoundMetrics` row per round at ``<run>/metrics/r<round>/rank-<r>.json``.
Once every member's row is in, one replica (the round's recorder) writes the round's
`RoundSummary` once, create-only, at ``<run>/rounds/r<round>.json``: the aggregate, every row,
the checks made across rows (θ digests that disagree, replicas training alone) and the round's
straggler: the member that arrived last, and the replica-seconds the others spent waiting for it.
`diloco run`, `diloco status` and the end-of-run report read summaries, listing only past the
last round they already have, so a refresh costs one LIST plus one GET per new round however
long the run is; a round whose recorder died is rebuilt from its rows. The launcher keeps what
it has read in ``rounds.jsonl`` beside the run record, so `status` on a finished run reads a
handful of objects.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..records import from_record
from .runkeys import RunKeys


# Where a replica's time in a round went, in order (seconds each; `RoundMetrics.phases`):
# compute: inner steps of the phase the round closes; upload: encoding and writing its shards;
# wait: waiting for the other members to be ready; reduce: reading its shards' contributions,
# averaging and publishing them; download: reading the other reduced shards; outer: the outer
# step (and a checkpoint on checkpoint rounds) and writing the model back.
PHASES = ("compute", "upload", "wait", "reduce", "download", "outer")


# Rows and summaries arrive from the store, which anyone holding its credentials can write: each
# field is decoded and checked against its declared type (`diloco.records`: numbers finite)
# before the launcher uses it, so a planted or garbled object is skipped like a torn one
# (RecordError is a ValueError) instead of crashing the supervisor.


def _json_safe(value: Any) -> Any:
    """`value` with every non-finite float as null: rows and summaries are valid JSON always."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _dumps(value: dict[str, Any]) -> bytes:
    """Valid JSON always: an eval point that is not finite is dropped (it is no point on a curve),
    any other non-finite number becomes null (a NaN loss: no loss)."""
    for d in [value, *value.get("rows", [])]:
        d["evals"] = [e for e in d.get("evals", []) if all(isinstance(x, (int, float)) and math.isfinite(x) for x in e)]
    try:
        return json.dumps(value, sort_keys=True, allow_nan=False).encode()
    except ValueError:
        return json.dumps(_json_safe(value), sort_keys=True, allow_nan=False).encode()


@dataclass
class RoundMetrics:
    """What one replica did in one round (written by diloco-replica, read here)."""

    round: int
    rank: int
    attempt: int = 0
    members: list[int] = field(default_factory=list)
    member: bool = True                 # whether this replica's update is in the round's mean
    loss: float | None = None           # mean inner loss since the previous round
    tokens: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    compute_s: float = 0.0
    sync_s: float = 0.0
    requests: dict[str, int] = field(default_factory=dict)
    takeovers: list[int] = field(default_factory=list)
    state_digest: str | None = None     # XXH3-64 of θ_global and of the outer momentum after the round
    incidents: list[dict[str, Any]] = field(default_factory=list)  # corrupt objects met, and what was done
    t: float = 0.0                      # wall clock when the round's outer step was applied here
    phases: dict[str, float] = field(default_factory=dict)  # seconds per PHASES entry
    hidden_s: float = 0.0               # overlap: seconds of the exchange that ran behind inner steps
    step: int = 0                       # the global inner step the round brings the model to
    total_steps: int | None = None      # the run's length in inner steps, as the training loop gave it
    parameters: int = 0                 # elements this replica syncs (every lane's fragment-sized model)
    evals: list[list[float]] = field(default_factory=list)  # [step, eval loss] the entrypoint reported

    def to_json(self) -> bytes:
        return _dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | memoryview) -> RoundMetrics:
        return from_record(cls, json.loads(bytes(raw)))


@dataclass
class RoundSummary:
    """One round over all its members: what progress displays show, and the cross-replica checks."""

    round: int
    members: list[int]
    reported: list[int]
    loss: float | None
    tokens: int
    tokens_per_s: float | None
    sync_share: float | None
    bytes_up: int
    bytes_down: int
    diverged: dict[str, Any] | None = None   # {"majority": [...], "minority": [...]} if θ digests disagree
    incidents: list[dict[str, Any]] = field(default_factory=list)
    rows: list[RoundMetrics] = field(default_factory=list)  # each member's own row, by rank
    straggler: int | None = None     # the member that arrived last (waited least for the others)
    waited_s: float = 0.0            # replica-seconds the other members spent waiting for it
    step: int = 0
    total_steps: int | None = None
    parameters: int = 0
    evals: list[list[float]] = field(default_factory=list)
    t: float = 0.0                   # when the last member applied the round

    @classmethod
    def from_rows(cls, round_: int, rows: list[RoundMetrics]) -> RoundSummary:
        losses = [r.loss for r in rows if r.loss is not None]
        compute = max((r.compute_s for r in rows), default=0.0)
        sync = max((r.sync_s for r in rows), default=0.0)
        tokens = sum(r.tokens for r in rows)
        wall = compute + sync
        straggler, waited = _straggler(rows)
        totals = [r.total_steps for r in rows if r.total_steps]
        return cls(
            straggler=straggler, waited_s=waited, step=max((r.step for r in rows), default=0),
            total_steps=max(totals) if totals else None, parameters=max((r.parameters for r in rows), default=0),
            evals=sorted(e for r in rows for e in r.evals), t=max((r.t for r in rows), default=0.0),
            round=round_, members=sorted({m for r in rows for m in r.members}),
            reported=sorted(r.rank for r in rows),
            loss=sum(losses) / len(losses) if losses else None, tokens=tokens,
            tokens_per_s=tokens / wall if wall > 0 else None, sync_share=sync / wall if wall > 0 else None,
            bytes_up=sum(r.bytes_up for r in rows), bytes_down=sum(r.bytes_down for r in rows),
            diverged=divergence(rows), incidents=[i for r in rows for i in r.incidents],
            rows=sorted(rows, key=lambda r: r.rank))

    @property
    def complete(self) -> bool:
        return set(self.members) <= set(self.reported)

    def to_json(self) -> bytes:
        return _dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | memoryview | str) -> RoundSummary:
        return from_record(cls, json.loads(raw if isinstance(raw, str) else bytes(raw)))


def _straggler(rows: list[RoundMetrics]) -> tuple[int | None, float]:
    """The member that arrived last, and the seconds every other member waited in the round.

    The last to arrive waits least (everyone else was already ready), so it is the member with
    the shortest `wait` phase; each replica measures its own wait on its own clock, so clock
    skew between machines does not move the answer.
    """
    members = [r for r in rows if r.member and "wait" in r.phases]
    if len(members) < 2:
        return None, 0.0
    last = min(members, key=lambda r: (r.phases["wait"], r.rank))
    return last.rank, sum(r.phases["wait"] for r in members if r is not last)


def divergence(rows: list[RoundMetrics]) -> dict[str, Any] | None:
    """Which replicas hold a global state different from the others', if any do.

    The majority digest wins; a tie goes to the digest of the lowest rank (with two replicas
    nothing better exists: the checkpoints are the arbiter, see diloco_replica.round.checkpoints).
    """
    digests = {r.rank: r.state_digest for r in rows if r.state_digest}
    if len(set(digests.values())) <= 1:
        return None
    counts = Counter(digests.values())
    best = max(counts.values())
    winner = min((rank for rank, d in digests.items() if counts[d] == best))
    good = digests[winner]
    return {"majority": sorted(r for r, d in digests.items() if d == good),
            "minority": sorted(r for r, d in digests.items() if d != good), "digest": good}


# Rounds a round returned without some member's row is watched for that row (`RoundReader.late_rows`).
LATE_ROUNDS = 20


class RoundReader:
    """Reads round summaries from a run's store, incrementally.

    `read_new()` returns summaries of rounds after the last one returned: one LIST of
    ``rounds/`` past that point and one GET per new summary. Rounds with rows but no summary
    (the recorder died) are rebuilt from their rows once a later summary exists or `final` is set.

    A round returned without every member's row (rebuilt while a paused replica's row was still
    to come, or summarised by a recorder that stopped waiting for it) stays watched for
    `LATE_ROUNDS` rounds: `late_rows()` hands out each row that comes after its round, once, so
    what it reports (an incident, a reset) is not lost.
    """

    def __init__(self, store: Any, run_id: str, after: int = 0):
        self.store, self.run_id, self.after = store, run_id, after
        self._incomplete: dict[int, tuple[set[int], set[int]]] = {}  # round → (members, ranks whose row was read)

    def _list_rounds(self, prefix: str) -> dict[int, list[str]]:
        """Round -> the keys under `prefix` (`RunKeys.summary()` or `.metrics()`) of rounds after `after`."""
        offset = f"{prefix}r{self.after:08d}~"  # every key of rounds ≤ after sorts before this
        found: dict[int, list[str]] = {}
        for meta in self.store.list(prefix, offset=offset):
            name = meta["path"][len(prefix):].split("/")[0].removesuffix(".json")
            if name.startswith("r") and name[1:].isdigit() and int(name[1:]) > self.after:
                found.setdefault(int(name[1:]), []).append(meta["path"])
        return found

    def read_new(self, *, final: bool = False) -> list[RoundSummary]:
        out: dict[int, RoundSummary] = {}
        for rnd, paths in self._list_rounds(RunKeys(self.run_id).summary()).items():
            raw = self.store.get(paths[0])
            if raw is not None:
                try:
                    out[rnd] = RoundSummary.from_json(raw)
                except (ValueError, TypeError, RecursionError):
                    continue
        newest = max(out, default=self.after)
        orphans = {}
        if final or out:  # rows listed only when a summary could be missing, not on every idle poll
            rows_of = self._list_rounds(RunKeys(self.run_id).metrics())
            orphans = {r: p for r, p in rows_of.items() if r not in out and (r < newest or final)}
        for rnd, paths in orphans.items():
            rows = []
            for path in paths:
                raw = self.store.get(path)
                if raw is not None:
                    try:
                        rows.append(RoundMetrics.from_json(raw))
                    except (ValueError, TypeError, RecursionError):
                        continue
            if rows:
                out[rnd] = RoundSummary.from_rows(rnd, rows)
        result = [out[r] for r in sorted(out)]
        if result:
            self.after = result[-1].round
        for rnd in result:
            if not rnd.complete:
                self._incomplete[rnd.round] = (set(rnd.members), set(rnd.reported))
        return result

    def late_rows(self) -> list[RoundMetrics]:
        """Rows written after their round was returned without them (one LIST per such round);
        each is returned once. A round is watched until it is complete or `LATE_ROUNDS` old."""
        late = []
        for rnd, (members, seen) in sorted(self._incomplete.items()):
            prefix = RunKeys(self.run_id).metrics(rnd)
            for meta in self.store.list(prefix):
                name = meta["path"][len(prefix):]
                rank = name.removeprefix("rank-").removesuffix(".json")
                if not (name.startswith("rank-") and rank.isascii() and rank.isdigit()) or int(rank) in seen:
                    continue
                seen.add(int(rank))
                raw = self.store.get(meta["path"])
                try:
                    row = RoundMetrics.from_json(raw) if raw is not None else None
                except (ValueError, TypeError, RecursionError):
                    continue
                if row is not None and row.round == rnd:
                    late.append(row)
            if members <= seen or rnd < self.after - LATE_ROUNDS:
                del self._incomplete[rnd]
        return late


class RoundCache:
    """Summaries already read, kept beside the run record (`rounds.jsonl`): status on a finished
    run reads them from disk, not from the store."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / "rounds.jsonl"

    def load(self) -> list[RoundSummary]:
        by_round: dict[int, RoundSummary] = {}
        try:
            for line in self.path.read_bytes().splitlines():
                try:
                    s = RoundSummary.from_json(line)
                except (ValueError, TypeError, RecursionError):  # ValueError: bad JSON, not UTF-8, a bad field
                    continue  # a line cut short by a killed process, or garbage a full disk left
                by_round[s.round] = s
        except FileNotFoundError:
            pass
        return [by_round[r] for r in sorted(by_round)]

    def append(self, summaries: list[RoundSummary]) -> None:
        if not summaries:
            return
        from ..host.statedir import private_file

        with private_file(self.path, "a") as f:
            f.write("".join(s.to_json().decode() + "\n" for s in summaries))


def read_rounds(rendezvous: str | None, run_id: str, *, store: Any = None, cache_dir: Path | None = None,
                final: bool = False) -> list[RoundSummary]:
    """Every round summary of a run: the cached ones, then what the store has past them.

    An unreachable store gives what the cache has (a shell without the store's credentials
    still sees the rounds its launcher recorded).
    """
    cache = RoundCache(cache_dir) if cache_dir else None
    known = cache.load() if cache else []
    if store is None and rendezvous:
        from .objectstore import open_store

        try:
            store = open_store(rendezvous)
        except Exception:
            return known
    if store is None:
        return known
    reader = RoundReader(store, run_id, after=known[-1].round if known else 0)
    try:
        new = reader.read_new(final=final)
    except Exception:  # the store may not exist yet, or be unreachable from this shell
        return known
    if cache:
        cache.append(new)
    return known + new
