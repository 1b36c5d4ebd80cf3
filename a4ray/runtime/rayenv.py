"""The environment a4ray gives Ray's own processes: on the pods of an A4 RayCluster (rendered into the
manifests) and, where it matters there too, on the embedded local cluster."""

# Every Ray node: the raylet reaps a dead worker's children (torchrun's ranks), and workers of a big image
# on a busy node get time to register.
RAY_ENV = {
    "RAY_kill_child_processes_on_worker_exit_with_raylet_subreaper": "true",
    "RAY_worker_register_timeout_seconds": "120",
}

# The head, for Ray Client (ray://): its proxy forks one server process per client while its gRPC threads
# are busy, and gRPC's fork handlers now and then crash or hang that child before it execs; the client
# gets "Starting Ray client server failed" (ray-project/ray#63202; here 2 in 76 connections, 4 at once,
# to a just-started local head; 0 in 76 with this; twice in CI). The proxy execs right after fork, the
# case gRPC's fork support is meant to be off for.
HEAD_ENV = {"GRPC_ENABLE_FORK_SUPPORT": "0"}

# A simulated cluster's GCS, for its nodes all on this machine: a node that is lost (its processes killed) is declared
# dead after 3 failed health checks a second apart, ~3 s, not Ray's 5 at 3 s, ~15 s (tuned for real networks, where
# a slow reply is not a lost node). What a4ray does about a lost node starts then: its gang's restart, a spare in
# its place, the bundle placed again. A check still times out at Ray's 10 s: a busy machine's slow raylet is not lost.
#
# Idle workers: Ray keeps up to a node's CPU count of them for as long as the cluster lives, each costing ~0.4 CPU-s a
# minute; a simulated cluster's are all on this machine (12 on a 3-node cluster after a few runs: 5.1 CPU-s a minute,
# ~9% of a core, for a `local up` left running all day). It keeps none idle for more than 10 s: a burst of tasks still
# reuses them (benchmarks/idle_cluster.py).
SIMULATED_IDLE_CONFIG = {"num_workers_soft_limit": 0, "idle_worker_killing_time_threshold_ms": 10_000}
SIMULATED_SYSTEM_CONFIG = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3,
                           **SIMULATED_IDLE_CONFIG}

# A simulated cluster's head, for its one log monitor (Ray starts none on the nodes it adds: it tails every node's
# files in their shared session directory). Below 1000 files it globs the log directory 10 times a second; this
# makes it twice a second, as Ray does above 1000 (a new worker's first lines reach the driver up to 0.5 s later).
SIMULATED_HEAD_ENV = {"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0"}
