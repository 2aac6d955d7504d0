"""The [diloco] settings: one declaration, validated once at the launcher and again in every replica."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from diloco.errors import SpecError
from diloco.options import describe_options
from diloco.spec.settings import DilocoSettings, RestartSettings

ROOT = Path(__file__).resolve().parents[3]


def test_defaults_are_the_declared_defaults_and_survive_the_trip_to_a_replica():
    s = DilocoSettings.from_table({})
    assert s.to_dict() == {o.name: o.default for o in describe_options(DilocoSettings)} and s.sync_every == 50
    tuned = DilocoSettings.from_table({"sync_every": 100, "fragments": 4, "transport": "int4", "outer_lr": 1})
    assert DilocoSettings.from_env(tuned.to_env()) == tuned and tuned.outer_lr == 1.0
    assert DilocoSettings.from_env(tuned.to_env(), sync_every=200).sync_every == 200


@pytest.mark.parametrize("text, expected", [
    ('{"sync_every": "50"}', "`diloco.sync_every` must be int, got '50' (a string)"),
    ('{"sync_evry": 50}', "unknown key `diloco.sync_evry`"),
    ('{"transport": "fp64"}', "`diloco.transport` must be one of"),
    ('{"sync_every": 50, "fragments": 3}', "must divide `diloco.sync_every`"),
    ('{"outer_lr": -1}', "`diloco.outer_lr` must be at least 0"),
    ('{"outer_lr": NaN}', "`diloco.outer_lr` must be a finite number"),
    ('{"round_timeout": Infinity}', "`diloco.round_timeout` must be a finite number"),
    ("[1, 2]", "must be a JSON object"),
    ("{not json", "is not JSON"),
])
def test_a_replica_checks_the_settings_it_receives(text, expected):
    with pytest.raises(SpecError) as err:
        DilocoSettings.from_env(text)
    assert expected in str(err.value) and str(err.value).startswith("DILOCO_SETTINGS")


def test_settings_have_no_json_form_but_their_own():
    s = DilocoSettings.from_table({"total_steps": 600})
    assert json.loads(s.to_env())["total_steps"] == 600 and json.loads(s.to_env())["parameters"] is None


def readme_defaults(path: Path, heading: str) -> dict[str, object]:
    """key -> default, from the markdown table under `heading` ("1 s" is 1; "all", "unset", "by store": None)."""
    def value(text: str) -> object:
        text = text.strip().strip("`").strip('"').removesuffix(" s")
        if text in ("true", "false"):
            return text == "true"
        try:
            return float(text)
        except ValueError:
            return text if re.fullmatch(r"[a-z0-9-]+", text) and text not in ("all", "unset") else None

    rows, table = {}, path.read_text().split(heading, 1)[1].split("\n\n| key ", 1)[1].split("\n\n", 1)[0]
    for line in table.splitlines()[2:]:
        keys_cell, default_cell = [c.strip() for c in line.strip("|").split("|")][:2]
        keys, defaults = re.findall(r"`(\w+)`", keys_cell), default_cell.split(", ")
        rows.update(zip(keys, defaults * len(keys) if len(defaults) == 1 else defaults))
    return {k: value(v) for k, v in rows.items()}


@pytest.mark.parametrize("declared, readme, heading", [
    (DilocoSettings, "packages/replica/README.md", "## Settings"),
    (RestartSettings, "packages/core/README.md", "## Supervision"),
])
def test_the_readme_tables_list_every_declared_setting_with_its_default(declared, readme, heading):
    """The READMEs' tables are written by hand: they must not drift from the one declaration."""
    documented = readme_defaults(ROOT / readme, heading)
    assert documented == {o.name: o.default for o in describe_options(declared)}  # 50.0 == 50
