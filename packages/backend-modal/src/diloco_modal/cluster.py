"""Function mode, inside a container: where this container stands in its Modal cluster.

A replica of `nodes = K` is one call of a function decorated with `@modal.clustered(size=K)`
(`modal.experimental.clustered` before modal 1.6): Modal starts K containers together, gives
every one the same input, and returns rank 0's output. Each container runs the replica's node
command (`diloco.procgroup.replica_command(P, K)`), told its node rank and the first container's
address from Modal's cluster info (`modal.experimental.get_cluster_info()`: `.rank` and
`.container_ips`, ordered by rank, in every SDK from the floor, 1.5.5, to 1.6), as torchrun's own
variables (`diloco.procgroup.node_env`): torch's static rendezvous on container 0, no service of
diloco's own.

A function whose cluster does not have exactly `nodes` containers cannot run the replica: a plain
function for `nodes = 2` would train one half of a replica that never completes, and a cluster of
2 for `nodes = 1` would run two replicas under one rank. `placement` says so in one line
(`ClusterMismatch`), which `run_replica` turns into exit 78, a configuration error: the run stops
instead of relaunching into the same mistake.

modal is imported here only inside a container (where Modal's runtime has already imported it),
and only to read the cluster info.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from diloco.procgroup import NODE_PORT, node_env

# Only diloco_modal.testing sets it: its containers all run on one machine and share one loopback,
# where the first containers of two replicas cannot both listen on NODE_PORT, so it says on which
# port this cluster's first container listens instead. On Modal every container has its own
# address, and NODE_PORT is free on each.
SHARED_HOST_PORT_ENV = "DILOCO_MODAL_NODE_PORT"


class ClusterMismatch(ValueError):
    """The function's cluster is not what the spec's `nodes` asks for (one line)."""


@dataclass(frozen=True)
class Placement:
    node_rank: int = 0
    env: dict[str, str] = field(default_factory=dict)  # torchrun's node variables; {} for one node


def cluster_size_and_rank() -> tuple[int, int, list[str]]:
    """(containers in this call's cluster, this container's rank, their addresses by rank); a
    container of a plain function is a cluster of one."""
    try:
        import modal.experimental
    except ImportError:  # not in a Modal container (a plain script): no cluster
        return 1, 0, []
    try:
        info = modal.experimental.get_cluster_info()
    except modal.exception.InvalidError:  # the SDK's answer outside a clustered function
        return 1, 0, []
    return len(info.container_ips), int(info.rank), list(info.container_ips)


def placement(nodes: int) -> Placement:
    """This container's node of the replica: its rank and torchrun's node variables, or
    `ClusterMismatch` when the function's cluster is not `nodes` containers."""
    size, rank, addresses = cluster_size_and_rank()
    if size != nodes:
        decorate = f"@modal.clustered(size={nodes})" if nodes > 1 else "no @modal.clustered"
        what = "a plain Modal function (one container per call)" if size == 1 else f"a cluster of {size} containers"
        raise ClusterMismatch(f"the spec asks for replicas of nodes = {nodes}, but this call runs on {what}: give "
                              f"the function {decorate} (modal.experimental.clustered before modal 1.6), or set "
                              f"nodes = {size}")
    if nodes <= 1:
        return Placement()
    port = int(os.environ.get(SHARED_HOST_PORT_ENV) or NODE_PORT)
    return Placement(rank, node_env(rank, addresses[0], port=port))
