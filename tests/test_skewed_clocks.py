"""Replicas whose wall clocks disagree by a minute, and one whose clock jumps mid-run, on real
local runs (`diloco.testing.clockskew`: rank 0 is 30 s ahead, rank 1 30 s behind, rank 2 right
until 6 s in and then 45 s ahead, as NTP stepping a clock does). Under fixed H and under
`round_seconds`: every round has every replica (no one is taken for late), no round waits,
the run ends bit-identical, and the timeline's wall-clock view lines the replicas up again
(`plots.clock_offsets`): rounds, timeouts and the timeline do not depend on agreeing clocks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import record_of, tiny_spec
from diloco.testing.clockskew import ENV_CLOCK_SKEW

SKEW = {0: 30.0, 1: -30.0, 2: 45.0}  # rank 2's after its jump
MODES = {"fixed H": "", "round_seconds": "round_seconds = 0.4\n"}


@pytest.mark.parametrize("mode", MODES)
def test_rounds_timeouts_and_the_timeline_do_not_depend_on_agreeing_clocks(tmp_path, mode):
    from diloco.metrics import RoundReader
    from diloco.store import open_store
    from diloco_replica.plots import clock_offsets

    state = tmp_path / "state"
    spec = tiny_spec(tmp_path, steps=160, sync_every=20, replicas=3)
    spec.write_text(spec.read_text().replace("round_timeout = 120", "round_timeout = 10\n" + MODES[mode]))
    env = {**os.environ, "DILOCO_STATE_DIR": str(state), ENV_CLOCK_SKEW: "0:30,1:-30,2:0@6:45"}
    out = subprocess.run([sys.executable, "-m", "diloco", "run", str(spec)], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    run_id = out.stdout.split()[1].rstrip(":")
    record = record_of(state, run_id)
    assert len({r["result"]["theta_digest"] for r in record["ranks"]}) == 1
    assert not any(r["restarts"] for r in record["ranks"])
    rounds = RoundReader(open_store(record["launch"]["rendezvous"]), run_id).read_new(final=True)
    assert len(rounds) >= 8 and all(r.members == [0, 1, 2] for r in rounds), [r.members for r in rounds]
    assert max(r.waited_s for r in rounds) < 5, [r.waited_s for r in rounds]  # nobody waited out a clock
    # the skews were real: the replicas' own wall clocks disagreed in the rows they wrote
    late = rounds[len(rounds) // 2:]
    t = {row.rank: row.t for row in late[-1].rows}
    assert t[0] - t[1] > 50 and t[2] - t[0] > 10, t
    # and the timeline lines them up again: each replica's clock against the rounds they share
    offsets = clock_offsets(late)
    assert offsets[0] - offsets[1] == pytest.approx(60, abs=3) and offsets[2] - offsets[0] == pytest.approx(15, abs=3)
    for rnd in late:
        aligned = [row.t - offsets[row.rank] for row in rnd.rows]
        assert max(aligned) - min(aligned) < 3, aligned
    status = subprocess.run([sys.executable, "-m", "diloco", "status", run_id, "--timeline", "--json"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert status.returncode == 0 and len(json.loads(status.stdout)["timeline"]) >= 24
