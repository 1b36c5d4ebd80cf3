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
