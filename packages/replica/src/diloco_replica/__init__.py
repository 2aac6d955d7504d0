"""diloco-replica: the runtime inside every replica — DiLoCo and the object-store all-reduce."""

from diloco.context import ReplicaContext
from diloco.metrics import RoundMetrics

from .allreduce import StoreAllReduce
from .diloco import DEFAULTS, DiLoCo, inner_optimizer
from .rounderrors import FellBehind, RoundFailed
from .wire import CorruptObject

__all__ = ["DEFAULTS", "CorruptObject", "DiLoCo", "FellBehind", "ReplicaContext", "RoundFailed",
           "RoundMetrics", "StoreAllReduce", "inner_optimizer"]
