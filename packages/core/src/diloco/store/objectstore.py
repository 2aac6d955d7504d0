"""Opening the run's object store from its rendezvous URI (obstore, imported lazily).

- ``file:///abs/path``: a local directory (created if missing). obstore writes local files
  through a temporary file and a rename, so readers never see a partial object.
- ``s3://bucket/prefix``: any S3-compatible endpoint; credentials, region and endpoint come
  from the usual AWS variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN,
  AWS_PROFILE, AWS_REGION / AWS_DEFAULT_REGION, AWS_ENDPOINT_URL). An http:// endpoint is
  allowed (moto, MinIO on a private network).
- ``gs://bucket/prefix``: Google Cloud Storage; credentials from GOOGLE_SERVICE_ACCOUNT (a key
  file path), GOOGLE_SERVICE_ACCOUNT_KEY (the key itself), GOOGLE_APPLICATION_CREDENTIALS, or
  the instance's metadata server.
- Azure Blob: ``az://container/prefix`` (also ``azure://``, ``adl://``, ``abfs://``, ``abfss://``),
  ``abfss://container@account.dfs.core.windows.net/prefix`` and
  ``https://account.blob.core.windows.net/container/prefix`` (or ``.dfs.``); the account and
  credentials from AZURE_STORAGE_ACCOUNT_NAME, AZURE_STORAGE_ACCOUNT_KEY / AZURE_STORAGE_SAS_KEY /
  AZURE_STORAGE_TOKEN, a service principal (AZURE_CLIENT_ID, AZURE_CLIENT_SECRET, AZURE_TENANT_ID),
  workload identity (AZURE_FEDERATED_TOKEN_FILE) or managed identity. AZURE_STORAGE_USE_EMULATOR=true
  (with AZURITE_BLOB_STORAGE_URL) talks to Azurite.
- ``memory://``: in-process, for unit tests.

Cloud URIs are parsed by obstore's `from_url`, the one parser of every form each cloud writes,
which also reads each cloud's variables; the URI's path becomes the store's key prefix there, so
callers address objects by run-relative keys. Create-only puts are If-None-Match on S3 and
Azure and ifGenerationMatch=0 on GCS; `verify_store` proves the store honours them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar
from urllib.parse import urlparse

from ..errors import StoreUnusable, UserError
from .runkeys import RunKeys
from .outage import REQUEST_RETRIES, Outage, StoreUnreachable

T = TypeVar("T")

_MEMORY_STORES: dict[str, Any] = {}


# Waiting for objects costs requests. On a local store they are free, so poll finely; on S3 each
# LIST/GET is billed and throttled (~5,500 GET/s per prefix), so start at 50 ms and back off to 1 s.
POLL_BY_SCHEME = {"file": (0.005, 0.05), "memory": (0.005, 0.05), "s3": (0.05, 1.0)}

# Schemes of object stores replicas on other machines can share (a cloud's), by cloud.
CLOUD_SCHEMES = {"s3": "aws", "gs": "gcp", "az": "azure", "azure": "azure", "adl": "azure", "abfs": "azure",
                 "abfss": "azure", "https": "azure"}
AZURE_HTTPS_HOSTS = (".blob.core.windows.net", ".dfs.core.windows.net")
SCHEMES = ("file", "memory", *CLOUD_SCHEMES)
# Keys per bulk-delete request, by cloud (obstore uses S3's DeleteObjects and Azure's blob batch;
# GCS has none and deletes one request a key).
BULK_DELETE = {"aws": 1000, "azure": 256}


def scheme_of(uri: str | None) -> str:
    """A rendezvous URI's scheme; none given means the local default, file://."""
    return (uri or "file://").split(":", 1)[0]


def poll_defaults(uri: str | None) -> tuple[float, float]:
    """(first wait, longest wait) between polls of the store at `uri` (a cloud store's if unknown)."""
    return POLL_BY_SCHEME.get(scheme_of(uri), POLL_BY_SCHEME["s3"])


class ObjectExists(Exception):
    """A create-only put found the key already there."""


@dataclass
class Store:
    """An obstore store (its prefix inside) and the URI it was opened from. Keys are
    '/'-separated and run-relative.

    `outage`: how this process waits out the store being away (`diloco.store.outage`): every
    request that fails transiently is tried again until the store answers or the outage limit
    passes. None (the launcher's stores): a request fails as soon as its own retries are spent,
    and the caller decides (the launcher's loop must never be held by the store)."""

    raw: Any
    uri: str
    outage: Outage | None = None

    def _call(self, fn: Callable[[], T]) -> T:
        return fn() if self.outage is None else self.outage.call(fn)

    def put(self, key: str, data: bytes | memoryview | list[bytes | memoryview], *,
            create_only: bool = False) -> None:
        """Write an object atomically; `data` may be a list of buffers (written without joining)."""
        import obstore
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        try:
            self._call(lambda: obstore.put(self.raw, key, data, mode="create" if create_only else "overwrite"))
        except (AlreadyExistsError, PreconditionError) as exc:
            raise ObjectExists(key) from exc

    def get(self, key: str) -> memoryview | None:
        """The object's bytes as a read-only zero-copy view, or None if it does not exist."""
        import obstore

        try:
            return memoryview(self._call(lambda: obstore.get(self.raw, key).bytes()))
        except FileNotFoundError:
            return None

    def list(self, prefix: str, *, offset: str | None = None) -> Iterator[dict[str, Any]]:
        """Objects under `prefix` (run-relative paths in 'path'), optionally after `offset`. The
        listing is read whole before it is handed out, so an outage never cuts one in half."""
        import obstore

        kwargs = {"offset": offset} if offset else {}
        for batch in self._call(lambda: list(obstore.list(self.raw, prefix, **kwargs))):
            yield from batch

    def list_dirs(self, prefix: str) -> list[str]:
        """The immediate "directories" under `prefix` (run-relative, no trailing slash)."""
        import obstore

        return list(self._call(lambda: obstore.list_with_delimiter(self.raw, prefix.rstrip("/")))["common_prefixes"])

    def delete(self, key: str) -> None:
        import obstore

        try:
            self._call(lambda: obstore.delete(self.raw, key))
        except FileNotFoundError:
            pass

    def delete_many(self, keys: list[str]) -> None:
        """Delete objects (absent ones are fine) in as few requests as the store allows: one
        DeleteObjects per 1,000 keys on S3, one blob batch per 256 on Azure (`BULK_DELETE`)."""
        import obstore

        if not keys:
            return
        try:
            self._call(lambda: obstore.delete(self.raw, list(keys)))
        except FileNotFoundError:  # a local or Azure store refuses the whole call for one absent key
            for key in keys:
                self.delete(key)

    @property
    def bulk_delete(self) -> int:
        """Keys one delete request takes on this store (1: no bulk delete)."""
        return BULK_DELETE.get(CLOUD_SCHEMES.get(scheme_of(self.uri), ""), 1)


def open_store(uri: str, *, outage_limit: float | None = None, log: Callable[[str], None] | None = None) -> Store:
    """Open the store a rendezvous URI names; a clear UserError for anything unusable.

    `outage_limit`: wait out the store being away for up to this many seconds (`Store.outage`;
    None: requests fail once their own retries are spent). `log` hears when it goes and comes back."""
    from obstore.store import LocalStore, MemoryStore

    parsed = urlparse(uri)
    if parsed.scheme == "file":
        path = parsed.path
        if not path.startswith("/"):
            raise UserError(f"rendezvous {uri!r}: file:// URIs need an absolute path (file:///abs/dir)")
        os.makedirs(path, exist_ok=True)
        return Store(LocalStore(path), uri, outage_of(uri, outage_limit, log))
    if parsed.scheme == "memory":
        name = parsed.netloc + parsed.path
        if name not in _MEMORY_STORES:
            _MEMORY_STORES[name] = MemoryStore()
        return Store(_MEMORY_STORES[name], uri, outage_of(uri, outage_limit, log))
    if parsed.scheme not in CLOUD_SCHEMES:
        raise UserError(f"rendezvous {uri!r}: unsupported scheme {parsed.scheme!r}; use {scheme_list()}")
    return Store(_open_cloud(uri, parsed), uri, outage_of(uri, outage_limit, log))


def outage_of(uri: str, limit: float | None, log: Callable[[str], None] | None) -> Outage | None:
    return Outage(uri, limit, log=log) if limit is not None else None


def scheme_list() -> str:
    return ", ".join(f"{s}://" for s in SCHEMES if s != "https") + " or https://<account>.blob.core.windows.net"


def _open_cloud(uri: str, parsed: Any) -> Any:
    """The obstore store for an s3/gs/Azure URI, its prefix inside."""
    from obstore.store import from_url

    cloud = CLOUD_SCHEMES[parsed.scheme]
    if parsed.scheme == "https" and not parsed.hostname.endswith(AZURE_HTTPS_HOSTS):
        raise UserError(f"rendezvous {uri!r}: an https:// rendezvous must be an Azure Blob URL "
                        f"(https://<account>.blob.core.windows.net/<container>/<prefix>)")
    if not parsed.netloc or (parsed.scheme == "https" and not parsed.path.strip("/")):
        what = {"aws": "bucket", "gcp": "bucket", "azure": "container"}[cloud]
        raise UserError(f"rendezvous {uri!r} names no {what}: write {parsed.scheme}://{what}/prefix")
    config: dict[str, Any] = {}
    client_options: dict[str, Any] | None = None
    if cloud == "aws":
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if endpoint:
            config["endpoint"] = endpoint
        if region:
            config["region"] = region
        if endpoint and endpoint.startswith("http://"):
            client_options = {"allow_http": True}
    r = REQUEST_RETRIES
    retries = {"max_retries": r["max_retries"], "retry_timeout": timedelta(seconds=r["retry_timeout_s"]),
               "backoff": {"init_backoff": timedelta(seconds=r["init_backoff_s"]),
                           "max_backoff": timedelta(seconds=r["max_backoff_s"])}}
    try:
        return from_url(uri, config=config or None, client_options=client_options, retry_config=retries)
    except Exception as exc:  # obstore's errors carry a multi-line debug dump: keep its first line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"rendezvous {uri!r}: cannot open the store: {first}{_CREDENTIAL_HINT[cloud]}") from None


_CREDENTIAL_HINT = {
    "aws": "",
    "gcp": " (set GOOGLE_SERVICE_ACCOUNT to a key file, or GOOGLE_APPLICATION_CREDENTIALS)",
    "azure": " (set AZURE_STORAGE_ACCOUNT_NAME and a credential such as AZURE_STORAGE_ACCOUNT_KEY)",
}


def verify_store(store: Store, run_id: str, who: str) -> None:
    """Prove the store can serve a run before training starts, or raise StoreUnusable.

    Write, read back, list, and a second create-only put of the same key, which must raise
    ObjectExists: a store that ignores If-None-Match would let two replicas both "win" every
    first-writer-wins decision (round membership, reduced shards, checkpoints) and silently
    disagree. The probe object is deleted afterwards.
    """
    import secrets

    keys = RunKeys(run_id)
    key = keys.probe(f"{who}-{secrets.token_hex(4)}")
    data = f"diloco probe {who}".encode()
    step = "write an object"
    try:
        store.put(key, data, create_only=True)
        step = "read the object back"
        got = store.get(key)
        if got is None or bytes(got) != data:
            raise StoreUnusable(f"rendezvous {store.uri!r}: an object written was not read back intact")
        step = "list objects"
        if not any(m["path"] == key for m in store.list(keys.probe())):
            raise StoreUnusable(f"rendezvous {store.uri!r}: an object written does not appear in a listing")
        step = "refuse a second create-only write"
        try:
            store.put(key, b"second writer", create_only=True)
        except ObjectExists:
            pass
        else:
            raise StoreUnusable(f"rendezvous {store.uri!r} ignores create-only writes (If-None-Match): replicas "
                                f"could not agree on anything; use a store that honours conditional puts")
    except (StoreUnusable, StoreUnreachable):  # (unreachable past the outage limit: not the store's setup)
        raise
    except Exception as exc:
        raise StoreUnusable(f"rendezvous {store.uri!r}: could not {step}: {type(exc).__name__}: "
                            f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}") from None
    finally:
        try:
            store.delete(key)
        except Exception:
            pass
