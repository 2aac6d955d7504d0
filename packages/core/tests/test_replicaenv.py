"""The replica environment contract and the secret-name rule."""

from __future__ import annotations

import pytest

from diloco.inputs.replicaenv import is_secret_name, parse_entrypoint, replica_env
from diloco.request import LaunchRequest


@pytest.mark.parametrize("name", ["HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "WANDB_API_KEY",
                                  "DB_PASSWORD", "GITHUB_TOKEN", "OPENAI_APIKEY", "GCP_CREDENTIALS", "SSH_PRIVATE_KEY"])
def test_secret_names(name):
    assert is_secret_name(name)


@pytest.mark.parametrize("name", ["TOKENIZERS_PARALLELISM", "MAX_TOKENS", "KEYBOARD", "WORLD_SIZE", "SECRETARY_NAME",
                                  "PYTHONPATH"])
def test_not_secret_names(name):
    assert not is_secret_name(name)


def test_redaction_and_env_contract():
    ep = parse_entrypoint("pkg.mod.fn")
    assert ep.function == "pkg.mod:fn"
    env = replica_env(rank=2, n_replicas=4, run_id="r", attempt=1, entrypoint=ep,
                      entrypoint_args={"lr": 0.1, "fast": True, "rank_env": "LOCAL_RANK", "deep": {"a": 1}},
                      rendezvous="file:///x", timeout=60, env={"HF_TOKEN": "t"})
    assert env["LOCAL_RANK"] == env["REPLICA_RANK"] == "2" and env["DILOCO_REPLICAS"] == "4" and "WORLD_SIZE" not in env
    assert env["LR"] == "0.1" and env["FAST"] == "true" and "DEEP" not in env
    assert env["DILOCO_ENTRYPOINT"] == "pkg.mod:fn" and env["DILOCO_ATTEMPT"] == "1"
    request = LaunchRequest(run_id="r", n_replicas=4, entrypoint=ep, env={"HF_TOKEN": "t", "LR_SCHEDULE": "cos"})
    assert request.secrets.names == ["HF_TOKEN"] and "HF_TOKEN" not in request.replica_env(0)
