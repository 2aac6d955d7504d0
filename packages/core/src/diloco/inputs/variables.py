"""Which environment variables a spec may set, and through which door: one list for all of them.

A spec reaches a replica's environment through five doors: `[args]` (scalars are exported
upper-cased), `[env]`, `secrets` (forwarded from the launcher's shell), `rank_env` (the
variable that receives the rank) and backend options that name variables (SageMaker's
`secret_refs`). Each name is checked here, against one table, before anything is recorded:

- **Reserved** names are never set by a spec, through any door: the process's plumbing (PATH,
  LD_PRELOAD, PYTHONHOME…: setting them hijacks or breaks the interpreter), diloco's and torch's
  rank contract (REPLICA_RANK, WORLD_SIZE, RANK, MASTER_ADDR…: a spec that sets them makes every
  replica rank 0, or breaks torchrun) and diloco's own DILOCO_* variables (the launcher writes
  them; a spec's value was silently overwritten before). A handful of DILOCO_* knobs meant for
  users (fault injection, store throttles, the preemption signal) stay settable.
- **Cloud** variables (AWS_*, AZURE_*, GOOGLE_*: credentials, endpoints, regions) address the
  store and prove who may use it. The launcher reads the store from its own shell, so these
  travel only through `secrets`: replicas then reach the same store, as the same identity, as
  the launcher watching them, and nothing of them is recorded.
- **Secret-looking** names (HF_TOKEN, WANDB_API_KEY, DB_PASS…) travel only through `secrets`.
"""

from __future__ import annotations

import re

from . import envvars
from ..errors import SpecError

NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

PLUMBING_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "PWD", "OLDPWD", "TMPDIR", "LANG", "TERM", "HOSTNAME", "IFS",
    "PYTHONPATH", "PYTHONHOME", "PYTHONUNBUFFERED", "PYTHONSTARTUP", "PYTHONSAFEPATH", "PYTHONINSPECT",
    "PYTHONEXECUTABLE", "PYTHONUSERBASE", "PYTHONNOUSERSITE", "PYTHONWARNINGS", "PYTHONBREAKPOINT",
    "BASH_ENV", "ENV",
})
# The rank contract (docs/design.md#environment) and torchrun's: `rank_env` may name one of
# these (a script that reads its rank from LOCAL_RANK), nothing else may set them.
RANK_NAMES = frozenset({
    envvars.ENV_RANK, "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK", "GROUP_RANK",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES",
})
# What `rank_env` may name among them: variables that hold a rank. Never a size, an address or
# the devices (`rank_env = "CUDA_VISIBLE_DEVICES"` once gave every replica the GPU of its rank number).
RANK_VALUED_NAMES = frozenset({envvars.ENV_RANK, "LOCAL_RANK", "RANK", "GROUP_RANK", "ROLE_RANK"})
RESERVED_NAMES = PLUMBING_NAMES | RANK_NAMES
RESERVED_PREFIXES = ("LD_", "DYLD_", "DILOCO_", "TORCHELASTIC_", "PET_", "KUBERNETES_", "PYTHON")
# DILOCO_* variables a user sets on purpose: fault injection for tests and soaks, the store
# throttles of bench/, and the signal a platform announces preemption with.
USER_DILOCO = ("DILOCO_FAULT_", "DILOCO_STORE_LATENCY_S", "DILOCO_STORE_BYTES_PER_S",
               envvars.ENV_PREEMPTION_SIGNAL)
CLOUD_PREFIXES = ("AWS_", "AZURE_", "GOOGLE_", "GCS_", "GCLOUD_", "CLOUDSDK_")

# Parts of a name that mark a secret: whole words (DB_PASS, GITHUB_PAT, wandb_key) or the end
# of a word (hftoken, ghsecret). TOKENS and TOKENIZER are counts and tools, not secrets.
_SECRET_WORDS = {"SECRET", "SECRETS", "TOKEN", "PASSWORD", "PASSWD", "PASS", "PWD", "PAT", "CREDENTIAL",
                 "CREDENTIALS", "APIKEY", "PASSPHRASE", "KEY", "PRIVATEKEY", "AUTH", "COOKIE", "SIG", "SAS"}
_SECRET_ENDINGS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "APIKEY", "PASSPHRASE", "CREDENTIAL", "CREDENTIALS")
_WORD = re.compile(r"[A-Z]+|[0-9]+")


def _words(name: str) -> list[str]:
    """`wandbApiKey` → WANDB, API, KEY; `DB_PASS` → DB, PASS; `hf-token` → HF, TOKEN."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name)
    return _WORD.findall(spaced.upper())


def is_secret_name(name: str) -> bool:
    """Whether a name (a variable, an entrypoint arg or a key at any depth) may hold a secret."""
    words = _words(name)
    return any(w in _SECRET_WORDS or w.endswith(_SECRET_ENDINGS) for w in words)


def is_reserved(name: str) -> bool:
    upper = name.upper()
    if upper in RESERVED_NAMES:
        return True
    if upper.startswith("DILOCO_") and upper.startswith(USER_DILOCO):
        return False
    return upper.startswith(RESERVED_PREFIXES)


def is_cloud(name: str) -> bool:
    return name.upper().startswith(CLOUD_PREFIXES)


def check_variable(where: str, door: str, key: str, name: str | None = None) -> None:
    """Refuse `name` (default: `key`) arriving through `door` in one `SpecError` line.

    `door` is how the spec writes it: "args", "env", "secrets", "rank_env" or "backend.<option>".
    """
    name = key if name is None else name
    shown = {"secrets": f"`secrets` entry {name!r}", "rank_env": f"`args.rank_env = {name!r}`"}.get(door, f"`{door}.{key}`")
    if not NAME.match(name):
        raise SpecError(f"{where}: {shown} is not an environment variable name (letters, digits, '_')")
    exported = f" (exported as {name})" if door == "args" and name != key else ""
    if is_reserved(name) and not (door == "rank_env" and name.upper() in RANK_VALUED_NAMES):
        raise SpecError(f"{where}: {shown}{exported} sets {name}, which replicas need for themselves (the "
                        f"process's plumbing or the rank contract); rename it (docs/security.md#variables)")
    if door in ("secrets",) or door.startswith("backend."):
        return
    if is_cloud(name):
        raise SpecError(f"{where}: {shown}{exported} is a cloud credential or store variable; list {name} in "
                        f"`secrets = [...]` and export it in your shell, so replicas reach the store the launcher "
                        f"watches and nothing of it is recorded")
    if is_secret_name(key):
        raise SpecError(f"{where}: {shown} looks like a secret; list its variable in `secrets = [...]` and export "
                        f"it in your shell, so its value never lands in files, records or dry runs")
