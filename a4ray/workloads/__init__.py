"""Workloads: what a node of the gang runs (`base.Workload`), and the programs ranks run under torchrun.

Kept free of imports: a rank's program (`python -m a4ray.workloads.ddp_worker`) imports this package,
and must not pay for Ray and every workload on each of its processes. `base.registered()` loads them.
"""
