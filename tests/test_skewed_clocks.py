"""Replicas whose wall clocks disagree by a minute, and one whose clock jumps mid-run, on real
local runs (`diloco.bootstrap.clockskew`: rank 0 is 30 s ahead, rank 1 30 s behind, rank 2 right
until the test has seen three rounds and then 45 s ahead, as NTP stepping a clock does; a
jump at seconds after start landed before the first round on an idle machine and in the
last rounds under load). Under fixed H and under
`round_seconds`: every round has every replica (no one is taken for late), no round waits,
the run ends bit-identical, and the timeline's wall-clock view lines the replicas up again
(`plots.clock_offsets`): rounds, timeouts and the timeline do not depend on agreeing clocks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import record_of, tiny_spec
from diloco.bootstrap.clockskew import ENV_CLOCK_SKEW

JUMP_AFTER_ROUND = 3

MODES = {"fixed H": "", "round_seconds": "round_seconds = 0.4\n"}


@pytest.mark.parametrize("mode", MODES)
def test_rounds_timeouts_and_the_timeline_do_not_depend_on_agreeing_clocks(tmp_path, mode):
    from diloco.store.metrics import RoundReader
    from diloco.store.objectstore import open_store
    from diloco_replica.records.plots import clock_offsets

    state = tmp_path / "state"
    jump = tmp_path / "jump"
    spec = tiny_spec(tmp_path, steps=160, sync_every=20, replicas=3)
    spec.write_text(spec.read_text().replace("round_timeout = 120", "round_timeout = 10\n" + MODES[mode]))
    env = {**os.environ, "DILOCO_STATE_DIR": str(state), ENV_CLOCK_SKEW: f"0:30,1:-30,2:0@{jump}:45"}
    launcher = subprocess.Popen([sys.executable, "-m", "diloco", "run", str(spec)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env)
    run_id = launcher.stdout.readline().split()[1].rstrip(":")
    watch = None
    seen, deadline = 0, time.monotonic() + 300  # rounds read from the store, as the launcher's lag grows under load
    while seen <= JUMP_AFTER_ROUND and launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
        try:
            watch = watch or RoundReader(open_store(record_of(state, run_id)["launch"]["rendezvous"]), run_id)
        except (FileNotFoundError, KeyError, ValueError):
            continue
        seen += len(watch.read_new())
    jump.touch()  # rank 2's clock steps 45 s ahead between rounds
    out, _ = launcher.communicate(timeout=600)
    assert launcher.returncode == 0, out
    record = record_of(state, run_id)
    assert len({r["result"]["theta_digest"] for r in record["ranks"]}) == 1
    assert not any(r["restarts"] for r in record["ranks"])
    rounds = RoundReader(open_store(record["launch"]["rendezvous"]), run_id).read_new(final=True)
    assert len(rounds) >= 8 and all(r.members == [0, 1, 2] for r in rounds), [r.members for r in rounds]
    assert max(r.waited_s for r in rounds) < 5, [r.waited_s for r in rounds]  # nobody waited out a clock
    # the skews were real: the replicas' own wall clocks disagreed in the rows they wrote, and
    # rank 2's jumped mid-run (from 30 s behind rank 0 to 15 s ahead) with rounds on both sides
    ahead = [{row.rank: row.t for row in r.rows} for r in rounds]
    assert all(t[0] - t[1] > 50 for t in ahead), ahead
    before = [r for r, t in zip(rounds, ahead) if t[2] - t[0] < -20]
    late = [r for r, t in zip(rounds, ahead) if t[2] - t[0] > 10]
    assert len(before) > JUMP_AFTER_ROUND and len(late) >= 3 and len(before) + len(late) >= len(rounds) - 1, ahead
    # and the timeline lines them up again: each replica's clock against the rounds they share
    offsets = clock_offsets(late)
    assert offsets[0] - offsets[1] == pytest.approx(60, abs=3) and offsets[2] - offsets[0] == pytest.approx(15, abs=3)
    for rnd in late:
        aligned = [row.t - offsets[row.rank] for row in rnd.rows]
        assert max(aligned) - min(aligned) < 3, aligned
    status = subprocess.run([sys.executable, "-m", "diloco", "status", run_id, "--timeline", "--json"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert status.returncode == 0 and len(json.loads(status.stdout)["timeline"]) >= 24
