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

from diloco.wiresize import Traffic

from .laps import Laps
from .storeaccess import reducer_of, shard_bounds
from .streaming import DeltaSource
from .wire import decode_tensor


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
    """Round `r` of a vector of `numel` values among `n` replicas, for the replica `rank`.

    The vector is cut into N·`parts` shards: replica i owns shards i·P … i·P + P − 1 (`owner`),
    each sent as an object of its own, so the steps of a round pipeline part by part.
    Made when the round starts (`members` are filled in once decided); `replay`: the round is
    read, not taken part in (`StoreAllReduce.fetch`), so it reports no phases and no NaN/Inf
    senders — the round's own members learnt those when it ran.
    """

    r: int
    numel: int
    n: int
    rank: int
    parts: int = 1                     # P: objects per replica's shard (`diloco.wiresize.parts_per_shard`)
    source: DeltaSource | None = None  # this replica's Δ (None: it contributes nothing)
    steps: int | None = None           # this replica's inner steps behind Δ (time-based rounds)
    replay: bool = False
    members: list[int] = field(default_factory=list)
    codec: str = "fp32"                # the run's transport codec
    sent: dict[int, list[memoryview]] = field(default_factory=dict)  # shards encoded before the upload, as sent
    incidents: list[dict[str, Any]] = field(default_factory=list)
    nonfinite: set[int] = field(default_factory=set)  # senders some shard's mean left out for NaN/Inf
    takeovers: list[int] = field(default_factory=list)  # shards this replica reduced for a dead reducer
    laps: Laps = field(default_factory=Laps)
    traffic_before: Traffic = field(default_factory=Traffic)
    stop: threading.Event = field(default_factory=threading.Event)  # set when a reduction fails: stop gathering
    started: float = field(default_factory=lambda: time.monotonic())  # looked up per call: benches swap `time`
    bounds: list[tuple[int, int]] = field(init=False)  # shard j is [a, b) of the round's vector

    def __post_init__(self) -> None:
        self.bounds = shard_bounds(self.numel, self.count)

    @property
    def count(self) -> int:
        """Shards in the round: N·P."""
        return self.n * self.parts

    def owner(self, j: int) -> int:
        """The replica whose shard j is: it keeps its own part of it and reduces it while a member."""
        return j // self.parts

    def reducer(self, j: int) -> int:
        """Who reduces shard j among the round's members (`storeaccess.reducer_of`)."""
        return reducer_of(j, self.members, self.parts)

    @property
    def member(self) -> bool:
        """Whether this replica's update is in the round's mean (it contributes and is a member)."""
        return self.source is not None and self.rank in self.members

    def size(self, j: int) -> int:
        """Values in shard j."""
        a, b = self.bounds[j]
        return b - a

    def own(self, j: int) -> torch.Tensor:
        """This replica's contribution to shard j, as the others decode it."""
        a, b = self.bounds[j]
        if j in self.sent:
            return decode_tensor(b"".join(self.sent[j]), self.codec, b - a)
        assert self.source is not None, "a replica that contributes nothing has no part of a shard"
        return self.source.shard(a, b)

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
