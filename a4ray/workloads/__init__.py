"""Workloads: what the nodes of a gang run (`workload.Workload`: a command per node, an output parser, a
typed result), and the attempt loop that relaunches a failed gang as the restart policy allows."""
