"""A reduced shard found corrupt is re-published by its reducer (`repairs.RepairDesk`): damaged
as it was written (a reducer bug), and with its reducer paused past the round timeout or gone."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch

from diloco.store.objectstore import open_store
from diloco_replica.round.allreduce import StoreAllReduce
from diloco_replica.transport.wire import Identity, unpack
from diloco.store.runkeys import RunKeys

from test_untrusted_objects import repacked


class FirstPutDamaged:
    """The run's store, except that the first write of `key` lands damaged (`repacked`): a reducer
    bug, where what it published is not what it holds. Damaged as written, never after, so no
    reader can see a good object first."""

    def __init__(self, store, key: str, **damage):
        self.store, self.key, self.damage, self.damaged = store, key, damage, False

    def __getattr__(self, name):
        return getattr(self.store, name)

    def put(self, key: str, data, *, create_only: bool = False) -> None:
        if key == self.key and not self.damaged:
            self.damaged = True
            data = repacked(b"".join(bytes(x) for x in (data if isinstance(data, list) else [data])), **self.damage)
        self.store.put(key, data, create_only=create_only)


@pytest.mark.parametrize("damage, problem", [("wrong length", "layout"), ("non-finite", "non-finite")])
def test_a_bad_reduced_shard_is_repaired_not_a_crash(damage, problem):
    store, run, n = open_store(f"memory://{uuid.uuid4().hex}"), "run-reduced-len", 2
    deltas = [torch.randn(2000, generator=torch.Generator().manual_seed(i)) for i in range(n)]
    damaging = FirstPutDamaged(store, RunKeys(run).reduced(1, 1), extra=int(damage == "wrong length"),
                               nan=damage == "non-finite")

    results, errors = {}, []
    ars = [StoreAllReduce(damaging if i == 1 else store, run, i, n, round_timeout=3.0, poll_interval=0.005,
                          poll_max=0.05) for i in range(n)]

    def go(i):
        try:
            results[i] = ars[i].run_round(1, deltas[i].clone())
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    for ar in ars:  # rank 1 answers repair requests until its next round (or the timeout), not after close
        ar.close()
    assert not errors, errors
    assert torch.equal(results[0].mean, results[1].mean)
    assert torch.isfinite(results[0].mean).all()
    [incident] = results[0].incidents
    assert problem in incident["problem"] and "re-published by its reducer" in incident["action"]


@pytest.mark.parametrize("away", [False, True, "claimed"], ids=["paused", "its attempt ended", "taken over"])
def test_a_reader_waits_for_a_live_reducer_to_repair_its_shard_and_voids_a_gone_ones(away):
    """Rank 1's reduced shard lands corrupt and rank 1 then pauses (no repair served) for 2.5
    round timeouts. Only rank 1 holds the mean it applied, so rank 0 waits for it while its attempt
    is live and gets the repair (it used to fail after one timeout, and every relaunch failed the
    same way while the reducer slept). Once the launcher marks that attempt away, nobody can ever
    get that mean (failing only made every relaunch fail replaying the round: the soak's crash
    loop), so after the window it is in rank 0 voids the shard's update: a zero mean at the
    re-publication's key, create-only, which the reducer, waking, cannot replace; and round 1's
    checkpoint is void. Unless someone took the shard over ("taken over": a claim in ``claim/``):
    its publisher may then be that live claimant, holding the mean, so nothing is voided and the
    round fails as before."""
    from diloco.store.presence import away_name

    timeout = 1.5
    store, run, n = open_store(f"memory://{uuid.uuid4().hex}"), f"run-paused-{away}", 2
    deltas = [torch.randn(2000, generator=torch.Generator().manual_seed(i)) for i in range(n)]
    damaging = FirstPutDamaged(store, RunKeys(run).reduced(1, 1), extra=1)
    ars = [StoreAllReduce(damaging if i == 1 else store, run, i, n, round_timeout=timeout, poll_interval=0.005,
                          poll_max=0.05) for i in range(n)]
    awake = threading.Event()
    serve = ars[1].repairs.serve_once
    ars[1].repairs.serve_once = lambda: serve() if awake.is_set() else False  # paused: answers nothing
    results, errors, ended = {}, [], {}

    def go(i):
        try:
            results[i] = ars[i].run_round(1, deltas[i].clone())
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)
        ended[i] = time.monotonic()

    t0 = time.monotonic()
    threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    [t.start() for t in threads]
    if away:  # once round 1 is formed with rank 1 in it
        while store.get(RunKeys(run).members(1)) is None:
            time.sleep(0.01)
        store.put(RunKeys(run).roster() + away_name(1, 0), b"")
        if away == "claimed":
            store.put(RunKeys(run).claim(1, 1, 0), b"2")
    time.sleep(2.5 * timeout)
    awake.set()
    [t.join() for t in threads]
    for ar in ars:
        ar.close()
    if away == "claimed":
        assert len(errors) == 1 and "did not re-publish it within" in str(errors[0]), errors
        assert store.get(RunKeys(run).repaired(1, 1)) is not None  # the reducer's own, once it woke: no void
        assert not [m for m in store.list(RunKeys(run).checkpoint(1)) if m["path"].endswith("/void")]
        return
    assert not errors, errors
    if away:
        assert ended[0] - t0 < 2.5 * timeout  # one window, not until the reducer woke
        voided = results[0].mean == 0
        assert int(voided.sum()) == 1000 and torch.equal(results[0].mean[~voided], results[1].mean[~voided])
        [incident] = results[0].incidents
        assert "voided" in incident["action"] and "rank 1" in incident["action"]
        names = [m["path"].rsplit("/", 1)[-1] for m in store.list(RunKeys(run).checkpoint(1))]
        assert names == ["void"], names
        obj = unpack(store.get(RunKeys(run).repaired(1, 1)), Identity(run, 1, "reduced", 1, -1), "repaired")
        assert obj.meta["void"] is True and not obj.tensor().any()  # what a replay reads too
        return
    assert torch.equal(results[0].mean, results[1].mean)
    [incident] = results[0].incidents
    assert "re-published by its reducer" in incident["action"]


def test_a_re_publication_that_is_corrupt_too_fails_the_round_at_once():
    """The reducer's re-publication is create-only: one that is corrupt as well will not get better,
    so the reader fails the round at once instead of waiting windows for a reducer that has
    already answered."""
    timeout = 2.0
    store, run, n = open_store(f"memory://{uuid.uuid4().hex}"), "run-twice-bad", 2
    deltas = [torch.randn(2000, generator=torch.Generator().manual_seed(i)) for i in range(n)]
    keys = RunKeys(run)
    damaging = FirstPutDamaged(FirstPutDamaged(store, keys.reduced(1, 1), extra=1), keys.repaired(1, 1), extra=1)
    ars = [StoreAllReduce(damaging if i == 1 else store, run, i, n, round_timeout=timeout, poll_interval=0.005,
                          poll_max=0.05) for i in range(n)]
    errors, ended = {}, {}

    def go(i):
        try:
            ars[i].run_round(1, deltas[i].clone())
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors[i] = exc
        ended[i] = time.monotonic()

    t0 = time.monotonic()
    threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    for ar in ars:
        ar.close()
    assert "so is its re-publication" in str(errors.get(0)), errors
    assert ended[0] - t0 < 2 * timeout  # not REPAIR_WINDOWS round timeouts


def test_a_corrupt_shard_whose_reducer_was_killed_is_voided_and_the_run_goes_on(replicas, store_uri, tmp_path):
    """The soak's crash loop (docs/benchmarks.md, "A thousand faults", run 10): rank 1 publishes
    round 2's reduced shard 1 with the wrong length and is SIGKILLed while it gathers, before any
    reader asked it to re-publish; the launcher marks it away and relaunches it. Nobody holds that
    mean any more, so the readers failed round 2, and every relaunch failed again replaying it,
    until the restart budget ran out. Now the readers void the shard's update after one round
    timeout, the relaunched rank replays the void, and all three end on one model."""
    import os
    import signal
    from pathlib import Path

    from diloco.store.metrics import read_rounds
    from diloco.store.presence import away_name, last_incarnation

    settings = {"sync_every": 2, "round_timeout": 2.0, "checkpoint_every": 2}
    env = {"DILOCO_FAULT_WRONG_LENGTH": "reduced:2:1", "DILOCO_FAULT_PHASE_FILE": str(tmp_path / "phase-{rank}"),
           "DILOCO_FAULT_PHASE_DELAY": "0.1"}
    first = replicas.launch("mlp_rounds", 3, rendezvous=store_uri, settings=settings, env=env,
                            args={"steps": 12, "dim": 16})
    marker, deadline = Path(tmp_path / "phase-1"), time.monotonic() + 120
    while time.monotonic() < deadline:  # "gather 2 <pid>": its shard is up, nobody has asked for a repair yet
        if marker.exists() and marker.read_text().split()[:2] == ["gather", "2"]:
            break
        time.sleep(0.005)
    else:
        raise AssertionError(f"rank 1 never gathered round 2: {marker.read_text() if marker.exists() else None}")
    os.killpg(first[1].metadata["pid"], signal.SIGKILL)
    open_store(store_uri).put(RunKeys(replicas.run_id).roster() + away_name(1, last_incarnation(0)), b"")  # the launcher's word
    again = replicas.launch("mlp_rounds", 3, rendezvous=store_uri, settings=settings, env=env, ranks=[1], attempt=1,
                            args={"steps": 12, "dim": 16})
    results = replicas.results([first[0], first[2], *again])
    assert len({r["final"] for r in results}) == 1
    rounds = {s.round: s for s in read_rounds(store_uri, replicas.run_id, final=True)}
    voided = [i for i in rounds[2].incidents if "voided" in i["action"]]
    assert voided and all(i["writer"] == 1 and "layout" in i["problem"] for i in voided), rounds[2].incidents
