"""`diloco-replica [module:function]` / `python -m diloco_replica`: the container entrypoint.

Runs the training function named on the command line (or in DILOCO_ENTRYPOINT) through the same
bootstrap every backend uses (`diloco.bootstrap.runner`): it gets a ReplicaContext built from the
environment (REPLICA_RANK, DILOCO_REPLICAS, DILOCO_RENDEZVOUS, DILOCO_RUN_ID, DILOCO_ATTEMPT), its
timeout is enforced, and its result or traceback is recorded.
"""

from __future__ import annotations

import os
import sys

from diloco.inputs import envvars
from diloco.bootstrap.runner import main as run_entrypoint


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    if args:
        os.environ[envvars.ENV_ENTRYPOINT] = args[0]
    if not os.environ.get(envvars.ENV_ENTRYPOINT):
        print("diloco-replica: name the training function (module:function) or set DILOCO_ENTRYPOINT",
              file=sys.stderr)
        return 2
    return run_entrypoint()


if __name__ == "__main__":
    sys.exit(main())
