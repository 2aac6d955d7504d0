"""`python -m diloco_modal.testing <diloco args>`: the diloco CLI with the modal client pointed at
the fake cloud whose root is in DILOCO_FAKE_MODAL (its server must be running). Tests may as
well run `python -m diloco` with `FakeModal.env`; this is a shortcut for a shell."""

from __future__ import annotations

import os

from . import FakeModal

os.environ.update(FakeModal.from_env().env)

from diloco.cli import main  # noqa: E402

main()
