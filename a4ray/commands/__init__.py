"""`a4ray <subcommand>` implementations: argument parsing and printing over the library.

`COMMANDS` lists every subcommand, the module of this package that defines it and what it does in one line:
the `a4ray` command (`a4ray/cli.py`) lists them from here without importing the modules (the job commands
import Ray, torch and megatron-core), and each module takes its commands' help from here.
"""

COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("jobs", "run a job spec on the cluster (or an embedded one); its `kind:` picks the job"),
    "convert": ("jobs", "convert a Hugging Face checkpoint to Megatron-core (cached; verified by default)"),
    "doctor": ("jobs", "check every node of a job's gang before training"),
    "stage": ("jobs", "stage a job's artifacts onto the workspace, exactly once"),
    "nccl-test": ("jobs", "is the network right? nccl-tests (or a torch benchmark) across the gang, with a verdict"),
    "deepep-test": ("jobs", "DeepEP's internode test across the gang"),
    "standins": ("jobs", "make the tiny local stand-ins of the Qwen3 checkpoints and datasets"),
    "nodes": ("nodes", "the workspace's node history: lost nodes, hang culprits, stragglers, doctor failures; "
              "`nodes forget HOST`"),
    "local": ("local", "a local Ray cluster of simulated A4 nodes to submit jobs to: up, down, status"),
    "render": ("kube", "print the KubeRay manifest (RayCluster, RayJob) of a spec"),
    "up": ("kube", "create the RayCluster of a spec on GKE and wait for its head"),
    "down": ("kube", "delete a RayCluster (or --job RayJob) and its storage objects"),
    "status": ("kube", "a4ray's RayClusters and RayJobs, one line each"),
    "submit": ("kube", "run a job: on a RayCluster (--cluster) or as a RayJob"),
    "logs": ("kube", "logs of a RayJob, or of a job on a RayCluster"),
}


def summary(command: str) -> str:
    """What `command` does, in one line (its help in `a4ray --help`)."""
    return COMMANDS[command][1]
