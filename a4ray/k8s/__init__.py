"""KubeRay on GKE A4: render job specs as RayCluster / RayJob manifests, validate them, and drive a cluster."""
