"""One round as this replica (this lane) sees it, in one object: `Round`.

A round's upload, reduce and gather steps all need the same facts — which round, how the vector
is cut into shards, who the members are, what this replica contributes — and all add to the
same record of what happened: incidents, senders left out for NaN/Inf, shards taken over, where
the time went. Passed as one `Round`, each step states what it reads and adds, and `result()`
turns the record into the caller's `RoundResult` in one place.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from diloco.store.wiresize import Traffic

from .laps import Laps
from .layout import Cut, clip
from .storeaccess import owner_of, reducer_of
from .streaming import DeltaSource, RoundSink
from ..transport.wire import decode_tensor


@dataclass
class RoundResult:
    round: int
    members: list[int]
    mean: torch.Tensor | None       # None when the round's means went to a sink, shard by shard
    member: bool                    # whether this replica's update is in the mean
    traffic: Traffic
    seconds: float
    takeovers: list[int] = field(default_factory=list)
    incidents: list[dict[str, Any]] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)  # upload / wait / reduce / download seconds
    nonfinite: list[int] = field(default_factory=list)  # ranks some shard's mean left out for NaN/Inf values


@dataclass
class Round:
    """Round `r` as lane `lane` of `lanes` of replica `rank` takes part in it.

    `cut` says what the round syncs and how it is cut (`layout.Cut`: N·P shards of a fragment of
    the model; replica i owns shards i·P … i·P + P − 1, `owner`); this lane holds `held` of it
    and contributes its piece of each shard it overlaps. `layouts` (every member's lane count)
    comes with the members, from the round's membership record.
    Made when the round starts; `replay`: the round is read, not taken part in
    (`StoreAllReduce.fetch`), so it reports no phases and no NaN/Inf senders — the round's own
    members learnt those when it ran.
    """

    r: int
    cut: Cut
    rank: int
    lane: int = 0
    lanes: int = 1
    source: DeltaSource | None = None  # this lane's Δ over `held` (None: it contributes nothing)
    steps: int | None = None           # this replica's inner steps behind Δ (time-based rounds)
    replay: bool = False
    members: list[int] = field(default_factory=list)
    layouts: dict[int, int] = field(default_factory=dict)  # member -> its lane count
    incarnations: dict[int, int] = field(default_factory=dict)  # member -> its incarnation (`gather`: is it gone?)
    roster: list[int] = field(default_factory=list)  # the ranks of the round, in order (`roster`; default 0 … N−1)
    codec: str = "fp32"                # the run's transport codec
    sent: dict[int, list[memoryview]] = field(default_factory=dict)  # pieces encoded before the upload, as sent
    incidents: list[dict[str, Any]] = field(default_factory=list)
    nonfinite: set[int] = field(default_factory=set)  # senders some shard's mean left out for NaN/Inf
    takeovers: list[int] = field(default_factory=list)  # shards this lane reduced for a dead reducer
    laps: Laps = field(default_factory=Laps)
    traffic_before: Traffic = field(default_factory=Traffic)
    stop: threading.Event = field(default_factory=threading.Event)  # set when a reduction fails: stop gathering
    started: float = field(default_factory=lambda: time.monotonic())  # looked up per call: benches swap `time`

    @property
    def held(self) -> tuple[int, int]:
        """What this lane holds of the round's vector."""
        return self.cut.held(self.lanes, self.lane)

    def __post_init__(self) -> None:
        if not self.roster:
            self.roster = list(range(self.cut.n))
        if len(self.roster) != self.cut.n:
            raise ValueError(f"round {self.r} is cut for {self.cut.n} replicas, its roster has {len(self.roster)}")

    def owner(self, j: int) -> int:
        """The replica whose shard j is (`storeaccess.owner_of`: position j mod N of the roster):
        it keeps its own piece of it and reduces it while a member."""
        return owner_of(j, self.roster)

    def reducer(self, j: int) -> tuple[int, int]:
        """(replica, lane) that reduces shard j among the round's members (`storeaccess.reducer_of`,
        then the lane of it holding the shard's first value)."""
        m = reducer_of(j, self.members, self.roster)
        return m, self.cut.lead(j, self.layouts.get(m, 1))

    def reduces(self, j: int) -> bool:
        """Whether this lane reduces shard j (its replica a member)."""
        return self.member and self.reducer(j) == (self.rank, self.lane)

    def keeps(self, j: int) -> bool:
        """Whether this lane keeps its piece of shard j instead of sending it: its replica owns
        the shard and this lane would reduce it (a member's lead lane)."""
        return self.owner(j) == self.rank and self.cut.lead(j, self.lanes) == self.lane

    @property
    def member(self) -> bool:
        """Whether this replica's update is in the round's mean (it contributes and is a member)."""
        return self.source is not None and self.rank in self.members

    def size(self, j: int) -> int:
        """Values in shard j."""
        a, b = self.cut.bounds[j]
        return b - a

    def piece(self, j: int) -> tuple[int, int]:
        """This lane's piece of shard j, in the round's coordinates (maybe empty)."""
        a, b = self.cut.bounds[j]
        return clip(a, b, *self.held)

    def mine(self) -> list[int]:
        """The shards this lane holds a piece of."""
        return self.cut.overlapping(*self.held)

    def own(self, j: int, device: torch.device | None = None) -> torch.Tensor:
        """This lane's piece of shard j, as the others decode it (an encoded piece decoded on
        `device`; Δ's piece where it is)."""
        p, q = self.piece(j)
        if j in self.sent:
            return decode_tensor(b"".join(self.sent[j]), self.codec, q - p, device)
        assert self.source is not None, "a replica that contributes nothing has no part of a shard"
        h = self.held[0]
        return self.source.shard(p - h, q - h, device)

    def deliver(self, sink: RoundSink, j: int, mean: torch.Tensor) -> None:
        """Hand `sink` what this lane holds of shard j's mean, in the lane's own coordinates."""
        a, _ = self.cut.bounds[j]
        p, q = self.piece(j)
        if p < q:
            h = self.held[0]
            sink(j, p - h, q - h, mean[p - a:q - a])

    def left_out(self, j: int, key: str, writer: int, problem: str, *, nonfinite: bool = False) -> dict[str, Any]:
        """Record that `writer`'s part of shard j is not in its mean (an incident); returns it."""
        incident = {"round": self.r, "object": key, "writer": writer, "problem": problem,
                    "action": f"left out of shard {j}'s mean by rank {self.rank}"}
        if nonfinite:
            incident.update(replica=writer, action=f"{incident['action']}; rank {writer} resets to θ_global")
        self.incidents.append(incident)
        return incident

    def result(self, mean: torch.Tensor | None, traffic: Traffic) -> RoundResult:
        """What the caller learns: `traffic` is the store's running count (this round's share is
        taken from the baseline the round started with)."""
        return RoundResult(self.r, self.members, mean, self.member, traffic.since(self.traffic_before),
                           time.monotonic() - self.started, self.takeovers, self.incidents,
                           {} if self.replay else {"upload": 0.0, **self.laps.seconds},
                           [] if self.replay else sorted(self.nonfinite))
