"""Counting a store's requests, for tests and benchmarks that assert how much reading costs."""

from __future__ import annotations

from typing import Any


class RequestCounter:
    """Wraps a `diloco.store.objectstore.Store` (or anything with get/list); counts GETs and LIST calls."""

    def __init__(self, store: Any):
        self.store, self.gets, self.lists = store, 0, 0

    def get(self, key: str):
        self.gets += 1
        return self.store.get(key)

    def list(self, prefix: str, offset: str | None = None):
        self.lists += 1
        return self.store.list(prefix, offset=offset)

    def take(self) -> dict[str, int]:
        """The counts so far, then start again from zero."""
        out = {"gets": self.gets, "lists": self.lists}
        self.gets = self.lists = 0
        return out
