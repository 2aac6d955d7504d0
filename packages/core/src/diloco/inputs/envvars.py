"""Environment variable names shared by launchers and the replica runtime.

Kept free of imports: the in-replica bootstrap reads these before anything else loads, and
every millisecond here is paid once per replica start.
"""

ENV_RANK = "REPLICA_RANK"
ENV_REPLICAS = "DILOCO_REPLICAS"  # the number of replicas (WORLD_SIZE is torch's: torchrun's group, or unset)
ENV_LANE = "RANK"  # set by torchrun: this process's index within its replica, across all its nodes
ENV_LANES = "WORLD_SIZE"  # set by torchrun: processes per replica (nodes × processes per node)
ENV_RENDEZVOUS = "DILOCO_RENDEZVOUS"
ENV_RUN_ID = "DILOCO_RUN_ID"
ENV_GROUP = "DILOCO_GROUP"  # the replica's group, in a run with [[group]] tables (diloco.spec.groups)
ENV_ATTEMPT = "DILOCO_ATTEMPT"
ENV_RERUN = "DILOCO_RERUN"  # the run of the attempt (0: its first), set by a backend whose platform runs
# an attempt again in place and numbers the runs (Slurm: SLURM_RESTART_COUNT; `diloco.store.presence`)
ENV_ENTRYPOINT = "DILOCO_ENTRYPOINT"
ENV_ENTRYPOINT_ARGS = "DILOCO_ENTRYPOINT_ARGS"
ENV_SETTINGS = "DILOCO_SETTINGS"
# A test's skewed wall clock for this rank (`diloco.bootstrap.clockskew`), installed by the runner.
ENV_FAULT_CLOCK_SKEW = "DILOCO_FAULT_CLOCK_SKEW"
ENV_TIMEOUT = "DILOCO_TIMEOUT"
ENV_RESULT_PATH = "DILOCO_RESULT_PATH"
ENV_STARTED_PATH = "DILOCO_STARTED_PATH"
ENV_VERSION = "DILOCO_VERSION"  # the diloco the run was launched with: 'diloco-core==X diloco-replica==Y'
ENV_SYNC_THREADS = "DILOCO_SYNC_THREADS"  # torch threads of a replica's sync process (default: torch's own)
ENV_PREEMPTION_SIGNAL = "DILOCO_PREEMPTION_SIGNAL"  # set by a backend whose platform announces preemption
# with a signal (Modal: SIGINT); the replica then exits 75 (preempted) instead of failing
ENV_CONFIG = "DILOCO_CONFIG"  # the launcher's user config file (default: <user config dir>/config.toml)
