"""Watching a run's rounds from the launcher: summaries from the store become events and metrics.

Each completed round's summary (`diloco.metrics.RoundSummary`, from the store) becomes a
``round`` event; a summary whose replicas disagree on θ becomes ``diverged``, a corrupt object a
replica met becomes ``incident``, and a run whose rounds all had a single member although it has
several replicas gets ``training_alone`` (the replicas are not meeting). Each new summary also
goes to the spec's metric sinks (`diloco.sinks`; TensorBoard by default).

Kept apart from the supervisor's restart logic: it only reads the store and writes the record's
events, `last_round` and `health`, which the supervisor saves with the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .failures import shorten
from .state import RunRecord


class RoundWatcher:
    """Reads new round summaries at most every `every` seconds; one LIST + one GET per new round."""

    def __init__(self, record: RunRecord, *, rendezvous: str | None, run_id: str, n_replicas: int,
                 clock: Callable[[], float], every: float = 1.0):
        self.record = record
        self.rendezvous, self.run_id, self.n_replicas = rendezvous, run_id, n_replicas
        self.clock, self.every = clock, every
        self.last_round = int(record.data.get("last_round", 0))
        self.health: dict[str, Any] = dict(record.data.get("health") or {})
        self._next_check = 0.0
        self._reader = None  # RoundReader over the run's store, opened once
        self._sinks: list[Any] | None = None  # the spec's metric sinks, opened at the first round

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
        from .metrics import RoundCache, RoundReader
        from .store import open_store

        if self._reader is None:
            try:
                self._reader = RoundReader(open_store(self.rendezvous), self.run_id, after=self.last_round)
            except Exception:  # unreachable from this shell: no round events, supervision goes on
                return False
        try:
            new = self._reader.read_new(final=final)
        except Exception:
            return False
        RoundCache(self.record.dir).append(new)
        self._write_sinks(new)
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
        return bool(new)

    def _write_sinks(self, summaries: list[Any]) -> None:
        """Each new round to every metric sink; a sink that fails is reported once and dropped."""
        if not summaries:
            return
        if self._sinks is None:
            from .sinks import open_sinks

            metrics = (self.record.data.get("spec") or {}).get("metrics") or {}
            try:
                self._sinks = open_sinks(metrics, self.run_id, self.record.dir)
            except Exception as exc:
                self.record.event("sink_failed", sink="*", error=shorten(str(exc)))
                self._sinks = []
        for sink in list(self._sinks):
            try:
                for summary in summaries:
                    sink.write(summary)
            except Exception as exc:
                self.record.event("sink_failed", sink=getattr(sink, "sink_name", "?"), error=shorten(str(exc)))
                self._sinks.remove(sink)

    def close(self) -> None:
        for sink in self._sinks or []:
            try:
                sink.close()
            except Exception:
                pass
        self._sinks = None

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
