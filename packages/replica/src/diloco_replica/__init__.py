"""diloco-replica: the runtime inside every replica — DiLoCo and the object-store all-reduce."""

from diloco.context import ReplicaContext

from .allreduce import RoundFailed, StoreAllReduce
from .diloco import DEFAULTS, DiLoCo, RoundInfo, inner_optimizer
from .wire import CorruptObject

__all__ = ["DEFAULTS", "CorruptObject", "DiLoCo", "ReplicaContext", "RoundFailed", "RoundInfo", "StoreAllReduce",
           "inner_optimizer"]
