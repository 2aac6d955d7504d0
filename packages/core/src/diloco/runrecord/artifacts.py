"""Run artifacts: files replicas leave in the store under ``<run>/artifacts/`` (a summary, a
loss curve), copied next to the run's records when the run ends, whatever the backend."""

from __future__ import annotations

from pathlib import Path

from ..store.runkeys import RunKeys
from .state import RunRecord
from ..host.statedir import private_file


def collect_artifacts(record: RunRecord) -> list[Path]:
    """Copy the run's artifacts from its store into ``runs/<run>/artifacts/``; return the files,
    private like the records beside them (a summary may hold the run's data)."""
    from ..store.objectstore import open_store

    rendezvous = record.rendezvous
    if not rendezvous:
        return []
    store = open_store(rendezvous)
    prefix = RunKeys(record.run_id).artifact()
    out = []
    for meta in store.list(prefix):
        name = meta["path"][len(prefix):]
        if not name or "/" in name or name.startswith("."):
            continue
        data = store.get(meta["path"])
        if data is None:
            continue
        dest = record.dir / "artifacts" / name
        with private_file(dest, "wb") as f:
            f.write(data)
        out.append(dest)
    return sorted(out)
