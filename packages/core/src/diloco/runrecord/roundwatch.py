"""Watching a run's rounds from the launcher: summaries from the store become events and metrics.

Each completed round's summary (`diloco.store.metrics.RoundSummary`, from the store) becomes a
``round`` event; a summary whose replicas disagree on θ becomes ``diverged``, a corrupt object a
replica met becomes ``incident``, and a run whose rounds all had a single member although it has
several replicas gets ``training_alone`` (the replicas are not meeting). Each new summary also
goes to the spec's metric sinks (`diloco.plugins.sinks`; TensorBoard by default), written on a
thread of their own (`diloco.runrecord.sinkwriter`).

Being the launcher's one regular reader of the store, it also says when the store stops
answering or taking writes (`store_unreachable`, and `store_back` when it answers again; `health`
holds the outage while it lasts, which the live bar and `diloco status` show), and for how long
(`store_gone_for`: the supervisor fails the run past `[diloco] store_outage_limit`). Writes are
proven by overwriting one small object every `WRITE_EVERY` seconds: a PUT is all the launcher's
documented permissions grant on the store (no delete), and rounds already read are recorded
whether or not the proof succeeds. A store this shell has never reached is not an outage: some
runs meet in a store only their replicas can reach.

Kept apart from the supervisor's restart logic: it only reads the store and writes the record's
events, `last_round` and `health`, which the supervisor saves with the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import time

from ..bootstrap.failures import shorten
from ..store.runkeys import RunKeys
from .sinkwriter import SinkWriter
from .state import RunRecord
from ..store.outage import first_line


# Seconds between the launcher's proofs that the store takes writes (a PUT overwriting one small
# object): reading summaries would not notice a full disk, which refuses writes only.
WRITE_EVERY = 30.0


class RoundWatcher:
    """Reads new round summaries at most every `every` seconds; one LIST + one GET per new round."""

    def __init__(self, record: RunRecord, *, rendezvous: str | None, run_id: str, n_replicas: int,
                 clock: Callable[[], float], every: float = 1.0):
        self.record = record
        self.rendezvous, self.run_id, self.n_replicas = rendezvous, run_id, n_replicas
        self.clock, self.every = clock, every
        self.last_round = int(record.data.get("last_round", 0))
        self.health: dict[str, Any] = dict(record.data.get("health") or {})
        self.health.pop("store_unreachable", None)  # a resumed launcher has not looked yet
        self._next_check = 0.0
        self._reader = None  # RoundReader over the run's store, opened once
        self._answered = False  # the store has answered this launcher (an outage is counted only after)
        self._away_since: float | None = None  # `clock` time the store stopped answering, while it does not
        self._next_write = 0.0  # when to prove next that the store still takes writes
        self._probe = RunKeys(run_id).probe("launcher")
        self.sinks = SinkWriter(record, run_id)  # the spec's metric sinks, beside the supervisor's loop

    @property
    def alone(self) -> bool:
        """Every round so far had one member although the run has several replicas."""
        return "alone" in self.health

    def state(self) -> dict[str, Any]:
        """What the run record keeps of the watch, so a resumed launcher goes on after it."""
        return {"last_round": self.last_round, "health": self.health}

    def poll(self, *, final: bool = False) -> bool:
        """Round summaries completed since the last look, as events; True if any.

        `final`: the replicas are done, so a round whose summary never came is rebuilt from its rows.
        """
        now = self.clock()
        if (now < self._next_check and not final) or not self.rendezvous:
            return False
        self._next_check = now + self.every
        from ..store.metrics import RoundReader
        from ..store.objectstore import open_store

        try:
            if self._reader is None:
                self._reader = RoundReader(open_store(self.rendezvous), self.run_id, after=self.last_round)
            new = self._reader.read_new(final=final)
        except Exception as exc:  # no round events meanwhile; supervision goes on
            return self._unanswered(exc, now)
        self._record_rounds(new)
        self._answered = True  # it answered a read: from here a failed look is an outage
        # reads alone would not see a full disk; while the store is away, every look proves writes too
        if not final and (now >= self._next_write or self._away_since is not None):
            self._next_write = now + WRITE_EVERY
            try:
                self._reader.store.put(self._probe, b"launcher")
            except Exception as exc:
                return self._unanswered(exc, now) or bool(new)
        answered = self._answer(now)
        late = self._late_incidents()
        return bool(new) or answered or late

    def _record_rounds(self, new: list[Any]) -> None:
        """Rounds read from the store become events, cached rows and sink points, in order."""
        from ..store.metrics import RoundCache

        RoundCache(self.record.dir).append(new)
        self.sinks.write(new)
        for rnd in new:
            self.record.event("round", round=rnd.round, members=rnd.members, loss=_rounded(rnd.loss),
                              tokens_per_s=round(rnd.tokens_per_s or 0), sync_share=_rounded(rnd.sync_share),
                              step=rnd.step, total_steps=rnd.total_steps, straggler=rnd.straggler,
                              waited_s=_rounded(rnd.waited_s))
            if rnd.diverged:
                self.record.event("diverged", round=rnd.round, minority=rnd.diverged["minority"],
                                  majority=rnd.diverged["majority"])
            for inc in rnd.incidents:
                self.record.event("incident", **{k: v for k, v in inc.items() if k != "round"}, round=rnd.round)
            self._check_alone(rnd.round, rnd.members)
            self.last_round = rnd.round

    def _late_incidents(self) -> bool:
        """Incidents in rows that came after their round (a paused replica's): events all the same."""
        try:
            rows = self._reader.late_rows()
        except Exception:  # the next look tries again
            return False
        for row in rows:
            for inc in row.incidents:
                self.record.event("incident", **{k: v for k, v in inc.items() if k != "round"}, round=row.round,
                                  late=True)
        return any(row.incidents for row in rows)

    def store_gone_for(self) -> float:
        """Seconds the store has not answered this launcher (0 while it answers)."""
        return 0.0 if self._away_since is None else self.clock() - self._away_since

    def _unanswered(self, exc: Exception, now: float) -> bool:
        """A look at the store failed; True if that starts an outage (the record changed)."""
        if not self._answered or self._away_since is not None:  # never reached from here, or already away
            return False
        self._away_since = now
        error = shorten(first_line(exc))
        self.health["store_unreachable"] = {"since": time.time(), "error": error}
        self.record.event("store_unreachable", rendezvous=self.rendezvous, error=error)
        return True

    def _answer(self, now: float) -> bool:
        """A look at the store succeeded; True if that ends an outage (the record changed)."""
        if self._away_since is None:
            return False
        away, self._away_since = now - self._away_since, None
        self.health.pop("store_unreachable", None)
        self.record.event("store_back", after_seconds=round(away, 1))
        return True

    def close(self) -> None:
        """Write the rounds still queued for the sinks, and close them."""
        self.sinks.close()

    def _check_alone(self, round_: int, members: list[int]) -> None:
        """A run of several replicas whose every round had one member is N unrelated trainings."""
        if self.n_replicas < 2 or self.health.get("met"):
            return
        if len(members) > 1:
            self.health.pop("alone", None)
            self.health["met"] = True
            return
        if "alone" not in self.health:
            self.record.event("training_alone", round=round_, ranks=members,
                              reason=f"every round so far had a single member although the run has "
                                     f"{self.n_replicas} replicas: they are not meeting in the store")
        self.health["alone"] = {"through_round": round_, "ranks": members}


def _rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 4)
