"""The tiny-LM main job with its replicas meeting in Azure Blob Storage (az://), against Azurite.

Remote means remote: the run goes through `backend = "eks"` (kmock's Kubernetes API and the
test-side kubelet from diloco_eks.testing), so each pod sees only what its manifest declares: the
account name, emulator URL and account key through `secrets` (a
Kubernetes Secret). One pod is SIGKILLed mid-run; its replacement rejoins from the global state in
the container, and every replica ends holding the same model.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import ROOT, events_of, one_global_model, tiny_spec, wait_for_round

pytest.importorskip("diloco_eks")


@pytest.fixture
def azure(monkeypatch):
    from diloco.testing.azurite import azurite, azurite_command

    if azurite_command() is None:
        if os.environ.get("CI"):
            pytest.fail("azurite-blob is not installed; .ci/run installs it (npm install azurite)")
        pytest.skip("azurite-blob not installed (npm install azurite; see CONTRIBUTING in the README)")
    with azurite() as server:
        for k, v in {**server["env"], **server["secret_env"]}.items():
            monkeypatch.setenv(k, v)
        yield server


@pytest.fixture
def cluster(tmp_path):
    from diloco_eks.testing import SimulatedCluster

    with SimulatedCluster(tmp_path / "cluster", extra_pythonpath=[str(ROOT / "examples" / "tiny-lm")]) as sim:
        yield sim
    assert not sim.error_traces, sim.error_traces


def on_azure(spec, az, cluster):
    text = spec.read_text().replace('backend = "local"\n', "")
    head, sep, rest = text.partition("\n[")
    names = ", ".join(f'"{k}"' for k in [*az["env"], "AZURE_STORAGE_ACCOUNT_KEY"])
    text = (head + f'\nrendezvous = "{az["uri"]}"\nsecrets = [{names}]\n' + sep + rest
            + f'\n[backend]\nname = "eks"\nimage = "ghcr.io/example/tiny-lm:1"\napi_url = "{cluster.url}"\n')
    spec.write_text(text)
    return spec


def test_replicas_meet_in_azure_blob_and_survive_a_killed_pod(tmp_path, azure, cluster):
    state = tmp_path / "state"
    env = {**os.environ, "DILOCO_STATE_DIR": str(state)}
    # Long enough that the killed replica's pod is back and takes part again (no round waits for it):
    # each phase of a round sleeps 0.25 s, so the 14 rounds after the kill last ~14 s however fast
    # the cores are, and the new pod (a process importing torch, slow on a loaded machine) meets a
    # run that is still going.
    phases = f'\n[env]\nDILOCO_FAULT_PHASE_FILE = "{tmp_path}/phase-{{rank}}"\nDILOCO_FAULT_PHASE_DELAY = "0.25"\n'
    spec = on_azure(tiny_spec(tmp_path, steps=400, sync_every=25, restart="backoff = 0.2\nmax_restarts_per_rank = 5",
                              extra=phases, replicas=3), azure, cluster)  # three pods: one killed, two to go on
    spec.write_text(spec.read_text().replace("round_timeout = 120", "round_timeout = 8\ncheckpoint_every = 2"))
    dry = subprocess.run([sys.executable, "-m", "diloco", "dryrun", str(spec)], capture_output=True, text=True,
                         env=env, timeout=120)
    assert dry.returncode == 0, dry.stderr
    assert azure["secret_env"]["AZURE_STORAGE_ACCOUNT_KEY"] not in dry.stdout + dry.stderr
    assert "prices                 azure" in dry.stderr
    launcher = subprocess.Popen([sys.executable, "-m", "diloco", "run", str(spec)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env)
    run_id = launcher.stdout.readline().split()[1].rstrip(":")
    wait_for_round(state, run_id, 2)
    record = json.loads((state / "runs" / run_id / "run.json").read_text())
    assert cluster.kill_pod(record["ranks"][2]["handle"]["metadata"]["job"], 2, signal.SIGKILL)
    out, _ = launcher.communicate(timeout=600)
    assert launcher.returncode == 0, out
    record = json.loads((state / "runs" / run_id / "run.json").read_text())
    one_global_model(record)
    assert record["ranks"][2]["restarts"] == 1
    rounds = [e for e in events_of(state, run_id) if e.get("event") == "round"]
    assert rounds[-1]["round"] == 16 and rounds[-1]["members"] == [0, 1, 2]
    names = [b.name for b in azure["client"].list_blobs(name_starts_with=f"runs/{run_id}/")]
    assert any("/reduced/" in n for n in names) and any("/rounds/" in n for n in names)  # they met in the container
    assert not any(p.name == "store" for p in (state / "runs" / run_id).iterdir())  # nothing on the launcher's disk
    for rank in range(3):
        logs = subprocess.run([sys.executable, "-m", "diloco", "logs", run_id, "--rank", str(rank)],
                              capture_output=True, text=True, env=env).stdout
        assert azure["secret_env"]["AZURE_STORAGE_ACCOUNT_KEY"] not in logs
