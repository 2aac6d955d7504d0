"""Limits on every value a spec holds, at any depth, checked before anything reads it closely.

Field checks (`diloco.spec.runspec`, `diloco.options`) know what each key means; these know what no
key may hold. A spec is data from a file someone edited, perhaps generated, perhaps pasted:

- **size and shape**: a string longer than `MAX_STRING` (a 10 MB value passed the dry run,
  then failed at launch because no environment takes it), an array or table larger than
  `MAX_ITEMS`, nesting deeper than `MAX_DEPTH` (5,000 nested arrays raised RecursionError);
- **NUL bytes** in any string or key: no environment variable, command line or HTTP header
  can carry one, so each backend failed differently, late;
- **non-finite numbers** anywhere (`[args] lr = nan` reaches the replica as invalid JSON);
- **credentials inside URIs**: `s3://KEY:SECRET@bucket`, an Azure URL with `?sig=`, a presigned
  URL. They are refused without echoing the value; credentials travel through `secrets`.

The walk is iterative: a hostile depth cannot exhaust Python's stack before it is refused.
"""

from __future__ import annotations

import math
import re
from collections.abc import Container
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from ..errors import SpecError
from .variables import is_secret_name

MAX_STRING = 32 * 1024       # one value; Linux takes 128 KiB per variable, and args travel as one JSON variable
MAX_ITEMS = 4096             # elements of one array or keys of one table
MAX_DEPTH = 16               # tables and arrays inside each other
MAX_SPEC_BYTES = 1 << 20     # a spec file
MAX_ARGS_JSON = 64 * 1024    # [args] as the JSON a replica receives in DILOCO_ENTRYPOINT_ARGS

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# Query parameters that carry a credential: Azure SAS (sig), S3/GCS presigned URLs, tokens.
_CREDENTIAL_PARAMS = {"sig", "signature", "x-amz-signature", "x-amz-credential", "x-amz-security-token",
                      "x-goog-signature", "x-goog-credential", "token", "access_token", "sas", "code", "key"}

# Where the part before @ names something else: an Azure container (abfs://container@account…),
# an ssh login (git+ssh://git@github.com/…).
_USER_IS_NOT_SECRET = {"abfs", "abfss", "az", "adl", "azure", "ssh", "git+ssh", "sftp"}


def uri_credentials(text: str) -> str | None:
    """What credential a URI carries ("user info", "a `sig` parameter"), or None."""
    if not _URL.match(text):
        return None
    try:
        parts = urlsplit(text)
    except ValueError:
        return None
    try:
        user, password = parts.username, parts.password
    except ValueError:
        return None
    if password is not None or (user and parts.scheme.lower() not in _USER_IS_NOT_SECRET):
        return "user info (user:password@)"
    for name, _ in parse_qsl(parts.query, keep_blank_values=True):
        if name.lower() in _CREDENTIAL_PARAMS or is_secret_name(name):
            return f"a `{name}` parameter"
    return None


def safe_uri(text: str) -> str:
    """The URI without user info, query or fragment: what an error may show of it."""
    try:
        parts = urlsplit(text)
    except ValueError:
        return "<unparseable URI>"
    host = parts.hostname or ""
    return f"{parts.scheme}://{host}{parts.path}"


def check_uri(where: str, key: str, text: str) -> str:
    """`text` unchanged, or one SpecError line (never echoing the credential) if it carries one."""
    found = uri_credentials(text)
    if found:
        raise SpecError(f"{where}: `{key}` ({safe_uri(text)}) carries {found}; remove it from the URI and give "
                        f"credentials through the cloud's own variables (AWS_ACCESS_KEY_ID, AZURE_STORAGE_SAS_TOKEN, "
                        f"GOOGLE_APPLICATION_CREDENTIALS…) listed in `secrets = [...]`")
    return text


def _path(parent: str, key: Any) -> str:
    if isinstance(key, int):
        return f"{parent}[{key}]"
    shown = key if len(key) <= 40 and key.isprintable() else repr(key[:40]) + "…"
    return f"{parent}.{shown}" if parent else shown


def secret_key_path(root: str, data: Any, *, allowed: Container[str] = ()) -> str | None:
    """The path of a key, at any depth of tables and arrays, that looks like a secret's name
    (`is_secret_name`), or None. Keys not in `allowed` only: a few name a secret without holding one.

    Whatever a spec's tables hold is recorded with the run and shown by `dryrun`, so a value under
    `api_key` would land in files; the walk is iterative, like `check_values`."""
    stack: list[tuple[str, Any]] = [(root, data)]
    while stack:
        path, value = stack.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in items:
            if isinstance(key, str) and key not in allowed and is_secret_name(key):
                return _path(path, key)
            stack.append((_path(path, key), item))
    return None


def check_values(where: str, data: Any, *, root: str = "") -> None:
    """Refuse, in one SpecError line naming the key, the first value no spec may hold."""
    stack: list[tuple[str, Any, int]] = [(root, data, 0)]
    while stack:
        path, value, depth = stack.pop()
        shown = path or "the spec"
        if isinstance(value, str):
            if "\x00" in value:
                raise SpecError(f"{where}: `{shown}` contains a NUL byte, which no environment, command line or "
                                f"request can carry; remove it")
            if len(value) > MAX_STRING:
                raise SpecError(f"{where}: `{shown}` is {len(value):,} characters; values are limited to "
                                f"{MAX_STRING:,} (put large data in a file in the workdir and pass its path)")
            check_uri(where, shown, value)
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise SpecError(f"{where}: `{shown}` must be a finite number, got {value!r}")
        elif isinstance(value, (dict, list)):
            if depth >= MAX_DEPTH:
                raise SpecError(f"{where}: `{shown}` nests tables or arrays more than {MAX_DEPTH} deep; flatten it")
            if len(value) > MAX_ITEMS:
                raise SpecError(f"{where}: `{shown}` holds {len(value):,} items; at most {MAX_ITEMS:,} are allowed")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str) and ("\x00" in key or len(key) > 256):
                    raise SpecError(f"{where}: a key in `{shown}` contains a NUL byte or is over 256 characters")
                stack.append((_path(path, key), item, depth + 1))
        elif value is not None and not isinstance(value, (bool, int)) and not _is_toml_time(value):
            raise SpecError(f"{where}: `{shown}` holds a {type(value).__name__}, which a spec cannot")


def _is_toml_time(value: Any) -> bool:
    import datetime

    return isinstance(value, (datetime.date, datetime.time))
