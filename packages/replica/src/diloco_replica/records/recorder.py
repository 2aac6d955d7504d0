"""Writing a round's record: each replica's metrics row, and the round's summary once per round.

The summary (`diloco.store.metrics.RoundSummary`) is written by the round's recorder — the reducer of
shard 0 — once every member's row is in (or two grace windows have passed: a member killed after
the round was decided never writes its row, and the launcher's live bar and timeline read the
summaries in order, so one dead member must not hold them for `round_timeout`), create-only, on
a background thread so training goes on. It carries the cross-replica checks: θ digests that
disagree (`diverged`), and the incidents members met. Every replica reads the summaries that
appeared since its last look (one LIST, one GET per new round) to learn whether its own state
is in the minority.

A recorder that closes while rows are still missing (a member killed mid-round never writes its
row; at the end of a run the others' last rows may still be on their way) writes nothing, rather
than wait up to `round_timeout` or write a summary short of rows that are coming: readers
rebuild a round without a summary from its rows (`diloco.store.metrics.RoundReader`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from diloco.store.metrics import RoundMetrics, RoundReader, RoundSummary
from diloco.store.objectstore import ObjectExists

from ..round.allreduce import StoreAllReduce
from ..round.storeaccess import reducer_of


class Recorder:
    def __init__(self, ar: StoreAllReduce, log: Callable[[str], None]):
        self.io, self.log = ar.io, log
        self.grace = ar.membership.grace  # how long a member's row may be late (`quorum`)
        self.reader: RoundReader | None = None
        self.closing = threading.Event()  # the replica leaves: stop waiting for rows

    def write_row(self, row: RoundMetrics) -> None:
        """The replica's row of its round. A non-member's (the round whose state it holds after
        catching up or rejoining) never replaces a row already there: this rank's own member row
        of that round, written before it fell behind, is the record of its work."""
        try:
            self.io.store.put(self.io.keys.metrics(row.round, row.rank), row.to_json(), create_only=not row.member)
        except ObjectExists:
            pass
        except Exception as exc:  # metrics are for people; never fail training over them
            self.log(f"could not write metrics for round {row.round}: {exc}")

    def maybe_summarize(self, r: int, members: list[int]) -> None:
        """If this replica records round r, write its summary in the background."""
        if members and reducer_of(0, members) == self.io.rank:
            self.io.pool.submit(self._summarize, r, members)

    def _summarize(self, r: int, members: list[int]) -> None:
        prefix = self.io.keys.metrics(r)
        # The raw store, not the counting one: this runs in the background, often inside the next
        # round's exchange, whose row must count the exchange alone (diloco.spec.estimate counts summaries
        # with the run's bookkeeping).
        store = self.io.store.store

        def names_now() -> list[str]:
            return [m["path"][len(prefix):] for m in store.list(prefix)]

        try:
            expected = {f"rank-{m}.json" for m in members}
            for _ in self.io.poll(f"round {r}'s metrics rows", timeout=min(self.io.round_timeout, 2 * self.grace()),
                                  wake=self.closing):
                names = names_now()
                if expected <= set(names):
                    break
            if self.closing.is_set() and not expected <= set(names):
                return  # leaving: readers rebuild this round from its rows
            rows = []
            for name in names:
                raw = store.get(prefix + name)
                if raw is not None:
                    rows.append(RoundMetrics.from_json(raw))
            summary = RoundSummary.from_rows(r, rows)
            store.put(self.io.keys.summary(r), summary.to_json(), create_only=True)
            if summary.diverged:
                self.log(f"round {r}: replicas {summary.diverged['minority']} hold a global state different from "
                         f"{summary.diverged['majority']}")
        except ObjectExists:
            pass
        except Exception as exc:  # the launcher rebuilds a missing summary from the rows
            self.log(f"could not write the summary of round {r}: {exc}")

    def diverged_since(self, after: int) -> int | None:
        """The first round (newer than `after`) in which this replica's state was in the minority."""
        if self.reader is None:
            self.reader = RoundReader(self.io.store, self.io.run_id, after=after)
        try:
            for summary in self.reader.read_new():
                if summary.diverged and self.io.rank in summary.diverged["minority"]:
                    return summary.round
        except Exception as exc:
            self.log(f"could not read round summaries: {exc}")
        return None

    def skip_through(self, r: int) -> None:
        """Ignore summaries of rounds ≤ r (they describe a state this replica has replaced)."""
        if self.reader is not None:
            self.reader.after = max(self.reader.after, r)
