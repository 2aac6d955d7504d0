"""The fake Modal server refuses what Modal refuses, and fails loudly where it does not know the
answer (an RPC it does not implement), so a test cannot pass on a request the service rejects."""

from __future__ import annotations

import pytest

from diloco.errors import UserError
from diloco.testing import launch
from diloco_modal.executor import ModalExecutor

SLEEP = "diloco.testing.entrypoints:sleep"


def test_an_rpc_the_fake_does_not_implement_fails_loudly(tmp_path, monkeypatch):
    from diloco_modal.testing import FakeModal, forget_modal_client

    import modal

    with FakeModal(tmp_path / "cloud") as fake:
        for key, value in fake.env.items():
            monkeypatch.setenv(key, value)
        forget_modal_client()
        with pytest.raises(Exception, match="QueueGetOrCreate is not implemented by diloco's fake Modal server"):
            modal.Queue.from_name("jobs", create_if_missing=True).hydrate()
        assert fake.unimplemented() == ["QueueGetOrCreate"]
    forget_modal_client()


@pytest.mark.parametrize("options,message", [
    ({"gpu_types": ["Z100"]}, "Modal refused to create the sandbox for rank 0: Invalid GPU type 'Z100'"),
    ({"region": "mars-north"}, "Modal refused to create the sandbox for rank 0: Invalid region 'mars-north'"),
    ({"secrets": ["nope"]}, "Modal cannot find what create the sandbox for rank 0 needs: Secret 'nope' not found "
                            "in environment 'main'"),
    ({"volumes": {"/data": "corpus"}}, "Modal cannot find what create the sandbox for rank 0 needs: Volume 'corpus' "
                                       "not found in environment 'main'"),
    ({"cloud": "azure"}, "Modal refused to create the sandbox for rank 0: Invalid cloud provider 'azure'"),
])
def test_what_modal_refuses_is_refused_in_one_line(fake_modal, options, message):
    gpu = "Z100" if "gpu_types" in options else None
    with pytest.raises(UserError) as err:
        launch(ModalExecutor(**options), 1, SLEEP, {"seconds": 1}, run_id="r1", gpu=gpu)
    assert message in str(err.value) and len(str(err.value).splitlines()) == 1, str(err.value)
    assert fake_modal.objects() == []


def test_limits_the_client_passes_through_are_enforced_by_the_service(fake_modal):
    import modal

    app = modal.App.lookup("direct", create_if_missing=True)
    with pytest.raises(modal.exception.InvalidError, match="timeout must be between 1 and 86400 seconds"):
        modal.Sandbox.create("true", app=app, timeout=25 * 3600)  # Modal's 24 h limit
    with pytest.raises(modal.exception.InvalidError, match="Invalid memory request 64 MiB"):
        modal.Sandbox.create("true", app=app, memory=64)
    sb = modal.Sandbox.create("sleep", "30", app=app, name="x" * 64, tags={"a": "1"})
    with pytest.raises(modal.exception.AlreadyExistsError, match="already exists"):
        modal.Sandbox.create("true", app=app, name="x" * 64)  # a name is unique among an app's running sandboxes
    with pytest.raises(modal.exception.InvalidError, match="Too many tags: 11"):
        sb.set_tags({f"k{i}": "v" for i in range(11)})
    assert sb.get_tags() == {"a": "1"}
    sb.terminate()
    assert sb.wait(raise_on_termination=False) is None and sb.returncode == 137


def test_a_token_the_service_does_not_accept_is_one_line(fake_modal, monkeypatch):
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-wrong")
    with pytest.raises(UserError, match=r"^Modal refused the token .*: run `modal token new`$"):
        launch(ModalExecutor(), 1, SLEEP, {"seconds": 1}, run_id="r1")


def test_the_readme_names_every_rpc_the_fake_implements():
    import re
    from pathlib import Path

    from diloco_modal.testing.server import implemented_rpcs

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("RPCs it implements")[1].split("Any\nother RPC")[0]
    named = set()
    for name, v2 in re.findall(r"`(\w+)(\(V2\))?`", section):
        named |= {name, f"{name}V2"} if v2 else {name}
    assert set(implemented_rpcs()) == named
