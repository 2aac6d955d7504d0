"""What a training function receives: who it is in the run, and where the run meets.

`ReplicaContext.from_env()` reads the variables every backend sets (see `diloco.inputs.replicaenv`),
so the same function runs unchanged under any backend, or from a plain script that sets them.
Deliberately light (no dataclasses, logging loaded on first use): every replica imports it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import cached_property


from ..inputs import envvars as v


class ReplicaContext:
    def __init__(self, rank: int, world_size: int, run_id: str, attempt: int = 0, rendezvous: str | None = None,
                 settings: dict[str, object] | None = None, args: dict[str, object] | None = None,
                 lane: int = 0, lanes: int = 1, rerun: int = 0):
        self.rank = rank              # this replica's index
        self.world_size = world_size  # the number of replicas (not torch's WORLD_SIZE inside a replica)
        self.lane, self.lanes = lane, lanes  # this process's index in its replica, and the replica's processes
        self.run_id = run_id
        self.attempt = attempt
        self.rerun = rerun            # the platform's run of this attempt (a Slurm requeue runs it again)
        self.rendezvous = rendezvous
        if settings is not None:
            self.settings = dict(settings)
        if args is not None:
            self.args = dict(args)
        self._raw_settings = "{}"
        self._raw_args = "{}"
        self.global_step: int | None = None  # kept current by the DiLoCo runtime; shown in failures

    @cached_property
    def settings(self) -> dict[str, object]:
        """The spec's [diloco] table (parsed on first use: JSON costs every replica start)."""
        return _parse_json(self._raw_settings)

    @cached_property
    def args(self) -> dict[str, object]:
        """The entrypoint arguments (the spec's [args] table)."""
        return _parse_json(self._raw_args)

    @property
    def incarnation(self) -> int:
        """This run of this attempt as one ordered number: what the rounds' presence markers and
        membership records name a replica by (`diloco.store.presence.incarnation`)."""
        from ..store.presence import incarnation

        return incarnation(self.attempt, self.rerun)

    def __repr__(self) -> str:
        return (f"ReplicaContext(rank={self.rank}, world_size={self.world_size}, run_id={self.run_id!r}, "
                f"attempt={self.attempt}, rerun={self.rerun}, rendezvous={self.rendezvous!r}, lane={self.lane}, lanes={self.lanes})")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ReplicaContext:
        env = os.environ if environ is None else environ
        # torchrun's group of the replica's processes, when there is one (a one-process replica may
        # carry its rank in RANK through `rank_env`: that is not a lane)
        lanes = int(env.get(v.ENV_LANES) or "1") if env.get(v.ENV_REPLICAS) else 1
        ctx = cls(
            rank=int(env.get(v.ENV_RANK, "0")),
            world_size=int(env.get(v.ENV_REPLICAS) or "1"),
            run_id=env.get(v.ENV_RUN_ID, "local"),
            attempt=int(env.get(v.ENV_ATTEMPT, "0")),
            rendezvous=env.get(v.ENV_RENDEZVOUS) or None,
            lane=int(env.get(v.ENV_LANE) or "0") if lanes > 1 else 0,
            lanes=lanes,
            rerun=_count(env, v.ENV_RERUN),
        )
        ctx._raw_settings = env.get(v.ENV_SETTINGS) or "{}"
        ctx._raw_args = env.get(v.ENV_ENTRYPOINT_ARGS) or "{}"
        return ctx

    @cached_property
    def log(self):
        """A logger that prefixes every line with the rank and attempt (and the platform's re-run
        of it, from the first requeue on)."""
        import logging
        import sys

        who = f"rank {self.rank}" + (f" process {self.lane}" if self.lanes > 1 else "")
        logger = logging.getLogger(f"diloco.replica.{self.rank}.{self.lane}")
        if not logger.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter(
                f"%(asctime)s [{who} attempt {self.attempt}{f' rerun {self.rerun}' if self.rerun else ''}] "
                f"%(levelname)s %(message)s"))
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
            logger.propagate = False
        return logger

    @cached_property
    def store(self):
        """The run's object store (opened on first use; needs a rendezvous URI), behind a
        throttled link only when the environment asks for one (`diloco.store.throttle`). A store that
        stops answering is waited for up to `[diloco] store_outage_limit` (`diloco.store.outage`)."""
        from ..spec.settings import DilocoSettings
        from ..store.objectstore import open_store
        from ..store.throttle import throttled_from_env

        if not self.rendezvous:
            raise RuntimeError(f"no rendezvous URI: set {v.ENV_RENDEZVOUS} or the spec's `rendezvous`")
        limit = self.settings.get("store_outage_limit")
        limit = float(limit) if isinstance(limit, (int, float)) else DilocoSettings.store_outage_limit
        return throttled_from_env(open_store(self.rendezvous, outage_limit=limit, log=self.log.warning))


def _count(env: Mapping[str, str], name: str) -> int:
    """A non-negative count from the environment (0 when unset); anything else is an error that
    names the variable."""
    text = env.get(name) or "0"
    if not (text.isascii() and text.isdigit() and len(text) <= 9):
        raise ValueError(f"{name}={text!r} is not a non-negative count: the backend that started this "
                         f"replica set it wrong")
    return int(text)


def _parse_json(text: str) -> dict[str, object]:
    if text in ("", "{}"):
        return {}
    import json

    return json.loads(text)
