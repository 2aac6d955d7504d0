"""A replica's environment within SageMaker's limits: at most 100 variables of at most 512 characters.

The limits are botocore's model of CreateTrainingJob (TrainingEnvironmentMap: 100 entries;
TrainingEnvironmentValue: 512). diloco's own values can exceed them legitimately — the
entrypoint args travel as JSON in DILOCO_ENTRYPOINT_ARGS, the settings in DILOCO_SETTINGS,
and a scalar arg is also exported as its own variable — so values the launcher makes are
shipped with the code instead: one JSON file per distinct set (`env-<hash>.json`, named by its
content, so ranks and relaunches share it and a create-only upload never conflicts), which the
bootstrap loads before the replica starts. The replica sees the same environment either way.

A long value from the spec's `[env]` is a mistake to fix, not to hide: it is refused at plan
time, before anything is uploaded, in one line naming the variable.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection

from diloco.errors import UserError

from .bootstrap import ENV_FILE_ENV

MAX_ENV_VALUE, MAX_ENV_ENTRIES = 512, 100


def env_file_name(values: dict[str, str]) -> str:
    digest = hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]
    return f"env-{digest}.json"


def fit_environment(env: dict[str, str], *, user_keys: Collection[str]) -> tuple[dict[str, str], dict[str, str]]:
    """(the job's Environment, values shipped in an env file): every value of the Environment
    is at most 512 characters. `user_keys` are the spec's [env] names, never moved."""
    kept: dict[str, str] = {}
    moved: dict[str, str] = {}
    for key, value in env.items():
        if len(value) <= MAX_ENV_VALUE:
            kept[key] = value
        elif key in user_keys and not key.startswith("DILOCO_"):
            raise UserError(f"[env] {key} is {len(value)} characters; SageMaker allows at most {MAX_ENV_VALUE} per "
                            f"environment value: put it in a file in the workdir and read it from there, or pass it "
                            f"as an entrypoint arg (args of any length are shipped with the code)")
        else:
            moved[key] = value
    if moved:
        kept[ENV_FILE_ENV] = env_file_name(moved)
    if len(kept) > MAX_ENV_ENTRIES:
        raise UserError(f"SageMaker allows at most {MAX_ENV_ENTRIES} environment variables per job; this run needs "
                        f"{len(kept)}: move some [env] entries into your code or into one JSON entrypoint arg")
    return kept, moved
