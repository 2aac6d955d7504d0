"""The [diloco] settings: one schema, validated once at the launcher and again in every replica."""

from __future__ import annotations

import json

import pytest

from diloco.errors import SpecError
from diloco.settings import DilocoSettings
from diloco.schema import DILOCO


def test_defaults_are_the_schema_defaults_and_survive_the_trip_to_a_replica():
    s = DilocoSettings.from_table({})
    assert s.to_dict() == {k: f.default for k, f in DILOCO.items()}
    tuned = DilocoSettings.from_table({"sync_every": 100, "fragments": 4, "transport": "int4", "outer_lr": 1})
    assert DilocoSettings.from_env(tuned.to_env()) == tuned and tuned.outer_lr == 1.0
    assert DilocoSettings.from_env(tuned.to_env(), sync_every=200).sync_every == 200


@pytest.mark.parametrize("text, expected", [
    ('{"sync_every": "50"}', "`diloco.sync_every` must be an integer"),
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
