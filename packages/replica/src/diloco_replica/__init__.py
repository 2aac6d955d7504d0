"""diloco-replica: the runtime inside every replica — DiLoCo and the object-store all-reduce."""

from diloco.bootstrap.context import ReplicaContext
from diloco.store.metrics import RoundMetrics

from .round.allreduce import StoreAllReduce
from .loop.diloco import DEFAULTS, DiLoCo, inner_optimizer
from .round.errors import FellBehind, RoundFailed
from .transport.wire import CorruptObject

__all__ = ["DEFAULTS", "CorruptObject", "DiLoCo", "FellBehind", "ReplicaContext", "RoundFailed",
           "RoundMetrics", "StoreAllReduce", "inner_optimizer"]
