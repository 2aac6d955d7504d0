"""Opening the run's object store from its rendezvous URI (obstore, imported lazily).

- ``file:///abs/path``: a local directory (created if missing). obstore writes local files
  through a temporary file and a rename, so readers never see a partial object.
- ``s3://bucket/prefix``: any S3-compatible endpoint; credentials, region and endpoint come
  from the usual AWS variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN,
  AWS_REGION / AWS_DEFAULT_REGION, AWS_ENDPOINT_URL). An http:// endpoint is allowed (moto,
  MinIO on a private network).
- ``memory://``: in-process, for unit tests.

`Store` wraps the obstore object with the few operations diloco needs and a key prefix, so
callers address objects by run-relative keys.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from .errors import StoreUnusable, UserError

_MEMORY_STORES: dict[str, Any] = {}


# Waiting for objects costs requests. On a local store they are free, so poll finely; on S3 each
# LIST/GET is billed and throttled (~5,500 GET/s per prefix), so start at 50 ms and back off to 1 s.
POLL_BY_SCHEME = {"file": (0.005, 0.05), "memory": (0.005, 0.05), "s3": (0.05, 1.0)}


def poll_defaults(uri: str | None) -> tuple[float, float]:
    """(first wait, longest wait) between polls of the store at `uri` (a cloud store's if unknown)."""
    scheme = (uri or "file://").split(":", 1)[0]
    return POLL_BY_SCHEME.get(scheme, POLL_BY_SCHEME["s3"])


class ObjectExists(Exception):
    """A create-only put found the key already there."""


@dataclass
class Store:
    """An object store plus a key prefix. Keys are '/'-separated, relative to the prefix."""

    raw: Any
    prefix: str
    uri: str

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def put(self, key: str, data: bytes | memoryview | list[bytes | memoryview], *,
            create_only: bool = False) -> None:
        """Write an object atomically; `data` may be a list of buffers (written without joining)."""
        import obstore
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        try:
            obstore.put(self.raw, self._key(key), data, mode="create" if create_only else "overwrite")
        except (AlreadyExistsError, PreconditionError) as exc:
            raise ObjectExists(key) from exc

    def get(self, key: str) -> memoryview | None:
        """The object's bytes as a read-only zero-copy view, or None if it does not exist."""
        import obstore

        try:
            return memoryview(obstore.get(self.raw, self._key(key)).bytes())
        except FileNotFoundError:
            return None

    def list(self, prefix: str, *, offset: str | None = None) -> Iterator[dict[str, Any]]:
        """Objects under `prefix` (run-relative paths in 'path'), optionally after `offset`."""
        import obstore

        kwargs = {"offset": self._key(offset)} if offset else {}
        strip = len(self.prefix) + 1 if self.prefix else 0
        for batch in obstore.list(self.raw, self._key(prefix), **kwargs):
            for meta in batch:
                yield {**meta, "path": meta["path"][strip:]}

    def list_dirs(self, prefix: str) -> list[str]:
        """The immediate "directories" under `prefix` (run-relative, no trailing slash)."""
        import obstore

        strip = len(self.prefix) + 1 if self.prefix else 0
        found = obstore.list_with_delimiter(self.raw, self._key(prefix.rstrip("/")))
        return [p[strip:] for p in found["common_prefixes"]]

    def delete(self, key: str) -> None:
        import obstore

        try:
            obstore.delete(self.raw, self._key(key))
        except FileNotFoundError:
            pass


def open_store(uri: str) -> Store:
    """Open the store a rendezvous URI names; a clear UserError for anything unusable."""
    from obstore.store import LocalStore, MemoryStore, S3Store

    parsed = urlparse(uri)
    if parsed.scheme == "file":
        path = parsed.path
        if not path.startswith("/"):
            raise UserError(f"rendezvous {uri!r}: file:// URIs need an absolute path (file:///abs/dir)")
        os.makedirs(path, exist_ok=True)
        return Store(LocalStore(path), "", uri)
    if parsed.scheme == "memory":
        name = parsed.netloc + parsed.path
        if name not in _MEMORY_STORES:
            _MEMORY_STORES[name] = MemoryStore()
        return Store(_MEMORY_STORES[name], "", uri)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise UserError(f"rendezvous {uri!r} names no bucket: write s3://bucket/prefix")
        config: dict[str, Any] = {}
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if endpoint:
            config["endpoint"] = endpoint
        if region:
            config["region"] = region
        client_options = {"allow_http": True} if endpoint and endpoint.startswith("http://") else None
        raw = S3Store(parsed.netloc, config=config, client_options=client_options)
        return Store(raw, parsed.path.strip("/"), uri)
    raise UserError(f"rendezvous {uri!r}: unsupported scheme {parsed.scheme!r}; use file://, s3:// or memory://")


def verify_store(store: Store, run_id: str, who: str) -> None:
    """Prove the store can serve a run before training starts, or raise StoreUnusable.

    Write, read back, list, and a second create-only put of the same key, which must raise
    ObjectExists: a store that ignores If-None-Match would let two replicas both "win" every
    first-writer-wins decision (round membership, reduced shards, checkpoints) and silently
    disagree. The probe object is deleted afterwards.
    """
    import secrets

    key = f"{run_id}/probe/{who}-{secrets.token_hex(4)}"
    data = f"diloco probe {who}".encode()
    step = "write an object"
    try:
        store.put(key, data, create_only=True)
        step = "read the object back"
        got = store.get(key)
        if got is None or bytes(got) != data:
            raise StoreUnusable(f"rendezvous {store.uri!r}: an object written was not read back intact")
        step = "list objects"
        if not any(m["path"] == key for m in store.list(f"{run_id}/probe/")):
            raise StoreUnusable(f"rendezvous {store.uri!r}: an object written does not appear in a listing")
        step = "refuse a second create-only write"
        try:
            store.put(key, b"second writer", create_only=True)
        except ObjectExists:
            pass
        else:
            raise StoreUnusable(f"rendezvous {store.uri!r} ignores create-only writes (If-None-Match): replicas "
                                f"could not agree on anything; use a store that honours conditional puts")
    except StoreUnusable:
        raise
    except Exception as exc:
        raise StoreUnusable(f"rendezvous {store.uri!r}: could not {step}: {type(exc).__name__}: "
                            f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}") from None
    finally:
        try:
            store.delete(key)
        except Exception:
            pass
