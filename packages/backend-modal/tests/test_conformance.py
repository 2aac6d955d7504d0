"""The core conformance kit, against both modes of the Modal backend: the real modal client in
front of the fake Modal server (diloco_modal.testing)."""

from __future__ import annotations

import pytest

from diloco.testing import ExecutorConformance, launch
from diloco_modal.executor import ModalExecutor


class TestSandboxModeConformance(ExecutorConformance):
    wait_timeout = 90.0

    @pytest.fixture(autouse=True)
    def _cloud(self, fake_modal):
        self.fake = fake_modal

    def make_executor(self):
        return ModalExecutor(app_name="diloco-conformance")


class TestFunctionModeConformance(ExecutorConformance):
    wait_timeout = 90.0

    @pytest.fixture(autouse=True)
    def _cloud(self, fake_modal, tmp_path, monkeypatch):
        import sys

        app_dir = tmp_path / "app"
        app_dir.mkdir()
        (app_dir / "replica_app.py").write_text(FUNCTION_APP)  # deployed with its module, as modal mounts it
        monkeypatch.syspath_prepend(str(app_dir))
        sys.modules.pop("replica_app", None)
        self.app_dir = app_dir

    def make_executor(self):
        return ModalExecutor(function="replica_app:replica", deploy=True)

    def launch(self, executor, entrypoint, args=None, **kwargs):
        kwargs.setdefault("workdir", str(self.app_dir))  # the spec's directory, where the function's module is
        return super().launch(executor, entrypoint, args, **kwargs)


FUNCTION_APP = '''
import modal

import diloco_modal

app = modal.App("diloco-conformance-fn")


@app.function(timeout=600)
def replica(rank: int, **launch):
    return diloco_modal.run_replica(rank, **launch)
'''


def test_a_failed_create_at_rank_k_cancels_the_ranks_already_started(fake_modal):
    from diloco.errors import BackendError

    fake_modal.fail_creates_after(1)
    with pytest.raises(BackendError, match=r"launching rank 1 on Modal failed: .*No GPU capacity.*the 1 replica\(s\) "
                                           r"already started were cancelled"):
        launch(ModalExecutor(), 3, "diloco.testing.entrypoints:sleep", {"seconds": 60}, run_id="r1")
    (started,) = fake_modal.objects("sb-")
    assert fake_modal.exit(started)["status"] == "terminated" and fake_modal.tags(started)["diloco-cancelled"] == "1"
