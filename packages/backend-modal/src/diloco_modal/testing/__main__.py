"""`python -m diloco_modal.testing <diloco args>`: the diloco CLI with the Modal double installed
(its root from DILOCO_FAKE_MODAL). For tests: this is how a launcher in another process, a second
shell's `diloco status` or a `diloco resume` see the same double."""

from __future__ import annotations

from . import FakeModal

FakeModal.from_env().install()

from diloco.cli import main  # noqa: E402

main()
