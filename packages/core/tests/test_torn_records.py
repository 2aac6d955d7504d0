"""The launcher's own records after a crash or a full disk: run.json cut short, not an object,
empty, or with a field of the wrong type; garbage appended to events.jsonl; a heartbeat or a
rank that is not a record. Every command that reads them (`status`, `status --json`, `logs`,
`resume`, `list`) says which file is damaged and carries on where it can: never a traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import write_spec

RUN_JSON_DAMAGE = {
    "cut in half": lambda text: text[: len(text) // 2],
    "a JSON list": lambda text: "[1, 2, 3]",
    "empty": lambda text: "",
    "not UTF-8": lambda text: "\udcff",  # written as the byte 0xff below
    "ranks not a list": lambda text: json.dumps({**json.loads(text), "ranks": "every one"}),
    "a rank not a record": lambda text: json.dumps({**json.loads(text), "ranks": [7]}),
    "a heartbeat not a record": lambda text: json.dumps({**json.loads(text), "launcher": "here"}),
    "a spec not a record": lambda text: json.dumps({**json.loads(text), "spec": [1]}),
    "a state not a string": lambda text: json.dumps({**json.loads(text), "state": {"x": 1}}),
    "no spec": lambda text: json.dumps({**json.loads(text), "spec": None}),
    "a creation time no date can show": lambda text: json.dumps({**json.loads(text), "created_at": 1e300}),
    "nested past what JSON reads": lambda text: "[" * 100_000,
}

EVENTS_DAMAGE = {
    "binary garbage": b"\xff\xfe\x00garbage\n",
    "a JSON list": b"[1, 2]\n",
    "a number": b"3\n",
    "an event without a name": b'{"t": 1.0, "rank": 0}\n',
    "an event of the wrong types": b'{"t": "soon", "event": 7, "rank": "zero"}\n',
    "a round of the wrong types": b'{"t": 1.0, "event": "round", "round": "three", "members": 5, "loss": [1], '
                                  b'"step": null, "total_steps": "x", "tokens_per_s": {}}\n',
    "a failure of the wrong types": b'{"t": 1.0, "event": "failed", "rank": [0], "attempt": "a", "error": 3}\n',
}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Two finished local runs (a damaged one must not hide the other), each with a round summary
    in its file store: their state directory, made once, and their ids."""
    root = tmp_path_factory.mktemp("recorded")
    (root / "rounds.py").write_text(
        "def main(ctx):\n"
        "    from diloco.store.metrics import RoundMetrics, RoundSummary\n"
        "    from diloco.store.runkeys import RunKeys\n"
        "    row = RoundMetrics(round=1, rank=0, members=[0, 1], loss=1.5, tokens=10)\n"
        "    if ctx.rank == 0:\n"
        "        ctx.store.put(RunKeys(ctx.run_id).summary(1), RoundSummary.from_rows(1, [row]).to_json())\n"
        "    return {'rank': ctx.rank}\n")
    (root / "store").mkdir()
    spec = write_spec(root, f'backend = "local"\nreplicas = 2\nentrypoint = "rounds:main"\n'
                            f'rendezvous = "file://{root / "store"}"\n'
                            f'[restart]\nmonitor_interval = 0.1\npolicy = "never"\n')
    env = {**os.environ, "DILOCO_STATE_DIR": str(root / "state")}
    ids = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-m", "diloco", "run", str(spec)], capture_output=True, text=True,
                              env=env, cwd=root, timeout=120)
        assert proc.returncode == 0, proc.stderr
        ids.append(proc.stdout.split()[1].rstrip(":"))
    # the round summaries cached beside each record (rounds.jsonl), as a first `status` leaves them
    for run_id in ids:
        subprocess.run([sys.executable, "-m", "diloco", "status", run_id], env=env, capture_output=True, timeout=60)
    return root / "state", ids


@pytest.fixture
def finished_run(recorded, state_dir):
    """The recorded runs, in this test's own state directory (a copy it may damage)."""
    shutil.copytree(recorded[0], state_dir)
    return recorded[1]


def no_traceback(proc) -> str:
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out
    return out


@pytest.mark.parametrize("damage", RUN_JSON_DAMAGE, ids=list(RUN_JSON_DAMAGE))
def test_a_damaged_run_json_is_named_and_the_other_runs_still_listed(cli, state_dir, finished_run, damage):
    damaged, other = finished_run
    path = state_dir / "runs" / damaged / "run.json"
    text = RUN_JSON_DAMAGE[damage](path.read_text())
    path.write_bytes(b"\xff" if damage == "not UTF-8" else text.encode())
    for args in (["status", damaged], ["status", damaged, "--json"], ["logs", damaged], ["resume", damaged]):
        proc = cli(*args)
        out = no_traceback(proc)
        [line] = [x for x in proc.stderr.splitlines() if x.strip()]
        if args[0] == "resume" and "already ended" in line:  # what it needs of the record is whole: a true answer
            assert proc.returncode != 0 and damage == "no spec", line
            continue
        assert str(path) in line and "damaged" in line, line
        # stopped in that one line, or (status, when what it shows is whole) carried on with it as a warning
        assert proc.returncode != 0 or (args[0] == "status" and line.startswith("warning:")), (args, out)
    listed = cli("list")
    out = no_traceback(listed)
    assert listed.returncode == 0 and other in out and damaged in out, out
    assert "DAMAGED run.json" in out or damage == "no spec", out  # a list needs no spec: shown with "?"






@pytest.mark.parametrize("log", ["events.jsonl", "rounds.jsonl"])
@pytest.mark.parametrize("damage", EVENTS_DAMAGE, ids=list(EVENTS_DAMAGE))
def test_garbage_in_an_append_only_log_is_skipped(cli, state_dir, finished_run, damage, log):
    """events.jsonl is read by every status view and by `resume`; rounds.jsonl by the status views
    (the timeline is drawn from it)."""
    run_id, _ = finished_run
    path = state_dir / "runs" / run_id / log
    assert path.exists()
    with open(path, "ab") as f:
        f.write(EVENTS_DAMAGE[damage])
    views = [["status", run_id]] if log == "events.jsonl" else [["status", run_id, "--timeline"]]
    for args in views:
        proc = cli(*args)
        no_traceback(proc)
        assert proc.returncode == 0, (args, proc.stderr)
    proc = cli("status", run_id, "--json")
    status = json.loads(no_traceback(proc))
    assert status["record"]["state"] == "SUCCEEDED" and [r["round"] for r in status["rounds"]] == [1]
    if log == "events.jsonl":
        proc = cli("resume", run_id)
        assert "already ended" in no_traceback(proc) or proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("line, kept", [
    (b'{"t": 1.5, "event": "round", "round": 3, "members": [0, 1], "loss": "nan", "step": 75}', True),
    (b'{"t": 1, "event": "failed", "rank": 0, "attempt": 2, "error": "killed by SIGKILL"}', True),
    (b'{"t": 1, "event": "launch", "ranks": [0, 1], "attempt": 0}', True),
    (b'{"t": 1, "event": "round", "round": 3, "members": 2}', False),  # readers take its len()
    (b'{"t": 1, "event": "round", "members": [0]}', False),  # a round event is shown by its round
    (b'{"t": 1e300, "event": "failed", "rank": 0}', False),  # no date a display can show
    (b'{"t": -5, "event": "failed", "rank": 0}', False),
    (b'[' * 100_000, False),  # nested deeper than json reads
    (b'{"t": 1, "event": "custom", "anything": {"goes": [1, "x"]}}', True),  # fields no reader indexes
    (b'{"t": 1, "event": "round", "round": 3.0}', False),
    (b'{"t": 1, "event": "round", "round": true}', False),
    (b'{"t": 1, "event": "round", "members": [0, "1"]}', False),
    (b'{"t": 1, "event": "round", "loss": [1]}', False),
    (b'{"t": 1, "event": "failed", "error": 3}', False),
    (b'{"t": NaN, "event": "round"}', False),
    (b'{"t": "1", "event": "round"}', False),
    (b'{"event": "round"}', False),
    (b'{"t": 1, "event": null}', False),
    (b'{"t": 1, "event": "round", "tokens_per_s": Infinity}', False),
    (b'{"t": 1, "event": "round"', False),
    (b'\xff\xfe', False),
    (b'[{"t": 1, "event": "round"}]', False),
    (b'', False),
])
def test_what_is_an_event(line, kept):
    from diloco.runrecord.eventlog import event_of

    assert (event_of(line) is not None) is kept
