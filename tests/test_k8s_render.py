"""Rendering job specs as KubeRay manifests: validated against the real KubeRay v1.7.0 CRDs.

The CRD schemas are read from `tests/fixtures/kuberay/` (the upstream files, provenance in its SOURCE.md)
and applied in strict mode with the API server's four behaviours (defaulted required fields, null
pruning, int32/int64 bounds, unknown fields refused), independently of the copy a4ray bundles.
"""

from __future__ import annotations

import functools
import gzip
import itertools
import json
import shlex
from pathlib import Path

import pytest
import yaml

from a4ray.cli import main as cli
from a4ray.core.errors import ManifestInvalid, SpecError
from a4ray.k8s import validate
from a4ray.k8s.render import OperatorCaps, default_entrypoint, render_cluster, render_job
from a4ray.spec import load_job
from a4ray.spec.cluster import GKE_BLOCK_LABEL, GKE_HOST_LABEL, GKE_SUBBLOCK_LABEL

REPO = Path(__file__).resolve().parents[1]
SCHEMAS = REPO / "tests" / "fixtures" / "kuberay"  # KubeRay v1.7.0's CRD files, unchanged (SOURCE.md there)
IMAGE = "kuberay.image=us-docker.pkg.dev/p/r/a4ray:25.12-ray2.60.0"
SECRET_VALUE = "hf_s3cr3tValueThatMustNeverAppear"

STORAGE = {
    "none": [],
    "filestore": ["kuberay.storage[0].type=filestore", "kuberay.storage[0].name=nfs",
                  "kuberay.storage[0].mount_path=/mnt", "kuberay.storage[0].server=10.0.0.3",
                  "kuberay.storage[0].share=vol1"],
    "filestore-inline": ["kuberay.storage[0].type=filestore", "kuberay.storage[0].name=nfs",
                         "kuberay.storage[0].mount_path=/mnt", "kuberay.storage[0].server=10.0.0.3",
                         "kuberay.storage[0].share=vol1", "kuberay.storage[0].claim=inline"],
    "lustre": ["kuberay.storage[0].type=lustre", "kuberay.storage[0].name=lustre", "kuberay.storage[0].mount_path=/mnt",
               "kuberay.storage[0].project=p", "kuberay.storage[0].location=us-central1-b",
               "kuberay.storage[0].instance=lfs", "kuberay.storage[0].ip=10.0.0.2"],
    "gcs+ssd": ["kuberay.storage[0].type=gcs", "kuberay.storage[0].name=data", "kuberay.storage[0].mount_path=/mnt",
                "kuberay.storage[0].bucket=my-bucket", "kuberay.storage[1].type=local_ssd",
                "kuberay.storage[1].name=ssd"],
}


@functools.cache
def shared_crd(kind: str) -> dict:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: these files are 1-1.4 MB
    return yaml.load((SCHEMAS / f"ray.io_{validate.PLURALS[kind]}.yaml").read_text(), Loader=loader)


def shared_validator(kind: str):
    """A strict validator built straight from the shared CRD file (not from a4ray's bundled copy)."""
    schema = validate.schema_from_crd(shared_crd(kind))
    return validate.Draft4Validator(validate._to_jsonschema(schema, strict=True),
                                    format_checker=validate.FormatChecker())


@pytest.fixture(scope="module")
def validators():
    return {kind: shared_validator(kind) for kind in validate.PLURALS}


def strict_errors(validators, obj: dict) -> list[str]:
    return [f"{list(e.absolute_path)}: {e.message}"
            for e in validators[obj["kind"]].iter_errors(validate.drop_nulls(obj))]


def spec_of(path: str, *sets: str):
    return load_job(REPO / path, [IMAGE, *sets])


def test_bundled_schemas_are_the_shared_v1_7_0_crds():
    for kind in validate.PLURALS:
        assert validate.bundled_schema(kind) == validate.schema_from_crd(shared_crd(kind)), kind
    raw = (REPO / "a4ray/k8s/crds/rayclusters.v1.json.gz").read_bytes()
    assert json.loads(gzip.decompress(raw))["properties"]["spec"]["properties"]["authOptions"]


def test_every_renderable_manifest_validates_strictly(validators):
    """All jobs/*.yaml, as RayCluster and RayJob, in every storage, RDMA, gIB, Kueue and auth mode."""
    specs = sorted(str(p.relative_to(REPO)) for p in (REPO / "jobs").glob("*.yaml"))
    assert "jobs/cluster-a4.yaml" in specs
    modes = list(itertools.product(
        STORAGE.values(),
        (["kuberay.rdma.mode=hostnetwork"], ["kuberay.rdma.mode=multinetwork"]),
        (["kuberay.gib.source=initcontainer"], ["kuberay.gib.source=hostpath"]),
        ([], ["kuberay.kueue.queue=a4-high", "kuberay.kueue.topology=required", "kuberay.kueue.level=subblock"]),
    ))
    checked = 0
    for path in specs:
        # Local rehearsal specs simulate fewer GPUs: A4 rendering refuses them until they ask for 8.
        a4 = []
        if load_job(REPO / path).cluster.gpus_per_node != 8:
            with pytest.raises(SpecError, match="cluster.gpus_per_node"):
                render_cluster(spec_of(path))
            a4 = ["cluster.gpus_per_node=8"]
        for storage, rdma, gib, kueue in modes:
            spec = spec_of(path, *a4, *storage, *rdma, *gib, *kueue)
            rendered = [render_cluster(spec).objects, render_job(spec, ["python", "-m", "a4ray.x"]).objects]
            if not kueue:
                rendered.append(render_job(spec, ["python", "-m", "a4ray.x"], cluster="a4").objects)
            for objects in rendered:
                for obj in objects:
                    if obj["kind"] in validate.PLURALS:
                        assert strict_errors(validators, obj) == [], (path, storage, rdma, gib, kueue)
                        checked += 1
    # auth through env (an old operator without authOptions) and auth off
    spec = spec_of("jobs/cluster-a4.yaml")
    for caps, sets in ((OperatorCaps(auth_options=False), []), (OperatorCaps(), ["kuberay.auth.mode=disabled"])):
        obj = render_cluster(spec.with_sets(sets), caps=caps).main
        assert strict_errors(validators, obj) == []
    assert checked >= len(specs) * len(modes) * 2


def test_a4_worker_pod_is_what_a_reviewer_expects():
    spec = spec_of("jobs/cluster-a4.yaml", "cluster.nodes=4", *STORAGE["gcs+ssd"])
    cluster = render_cluster(spec).main
    assert cluster["apiVersion"] == "ray.io/v1" and cluster["spec"]["enableInTreeAutoscaling"] is False
    (group,) = cluster["spec"]["workerGroupSpecs"]
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 4
    (spared,) = render_cluster(spec.with_sets(["cluster.spare_nodes=1", "restart.max_restarts=1"])).main["spec"][
        "workerGroupSpecs"]
    assert spared["replicas"] == spared["minReplicas"] == spared["maxReplicas"] == 5  # a pod for the spare too
    assert group["resources"] == {spec.cluster.node_resource: "1"}  # what the gang's placement group asks for
    pod = group["template"]["spec"]
    (ray,) = pod["containers"]
    assert ray["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert ray["securityContext"] == {"privileged": True}
    assert pod["nodeSelector"]["cloud.google.com/gke-accelerator"] == "nvidia-b200"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in ray["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "250Gi"}
    assert volumes[mounts["/usr/local/gib"]] == {"name": "gib", "emptyDir": {}}
    assert volumes[mounts["/usr/local/nvidia"]]["hostPath"]["path"] == "/home/kubernetes/bin/nvidia"
    (installer,) = pod["initContainers"]
    assert installer["image"].endswith("nccl-plugin-gib:v1.1.1")
    assert "/target/usr/local/gib" in installer["args"][0]
    assert installer["volumeMounts"] == [{"name": "gib", "mountPath": "/target/usr/local/gib"}]
    assert volumes[mounts["/ssd"]]["hostPath"]["path"] == "/mnt/stateful_partition/kube-ephemeral-ssd"
    assert volumes[mounts["/mnt"]]["csi"]["volumeAttributes"]["bucketName"] == "my-bucket"
    annotations = group["template"]["metadata"]["annotations"]
    assert annotations["gke-gcsfuse/volumes"] == "true"
    assert annotations["ray.io/overwrite-container-cmd"] == "true"
    # The launcher (which prepends gIB's lib64 to the image's LD_LIBRARY_PATH) runs with the spec's
    # gIB script and the gang's topology label keys.
    assert ray["command"] == ["/bin/bash", "/opt/a4ray/launchers/ray-node.sh"]
    env = {e["name"]: e for e in ray["env"]}
    assert env["A4RAY_GIB_SCRIPT"]["value"] == "/usr/local/gib/scripts/set_nccl_env.sh"
    assert env["A4RAY_TOPOLOGY_KEYS"]["value"] == f"{GKE_BLOCK_LABEL},{GKE_SUBBLOCK_LABEL},{GKE_HOST_LABEL}"
    assert "LD_LIBRARY_PATH" not in env  # a pod-spec value would replace the image's, not prepend to it
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token", "optional": True}
    # A pod's deletion (GKE maintenance, preemption): its ranks save at the iteration they reached before Ray is
    # stopped, within the grace period (runtime/notice.py's main, tested in test_notice).
    assert ray["lifecycle"]["preStop"]["exec"]["command"] == ["python", "-m", "a4ray.runtime.notice", "--grace-s",
                                                              "300"]
    assert pod["terminationGracePeriodSeconds"] == 330
    # Head: CPU pool, no Ray work, dashboard port, inside the cluster only, token auth by the operator.
    head = cluster["spec"]["headGroupSpec"]
    assert head["serviceType"] == "ClusterIP" and head["rayStartParams"]["num-cpus"] == "0"
    (head_ray,) = head["template"]["spec"]["containers"]
    assert {"name": "dashboard", "containerPort": 8265} in head_ray["ports"]
    assert "nvidia.com/gpu" not in head_ray["resources"]["limits"]
    assert "/ssd" not in {m["mountPath"] for m in head_ray["volumeMounts"]}  # local SSD is on GPU nodes only
    assert cluster["spec"]["authOptions"] == {"mode": "token"} and cluster["spec"]["rayVersion"] == "2.60.0"


def test_modes_change_what_they_should():
    multi = render_cluster(spec_of("jobs/cluster-a4.yaml", "kuberay.rdma.mode=multinetwork",
                                   "kuberay.gib.source=hostpath")).main
    pod = multi["spec"]["workerGroupSpecs"][0]["template"]
    assert "hostNetwork" not in pod["spec"] and "securityContext" not in pod["spec"]["containers"][0]
    interfaces = json.loads(pod["metadata"]["annotations"]["networking.gke.io/interfaces"])
    assert [i["network"] for i in interfaces] == ["default", "gvnic-1", *(f"rdma-{i}" for i in range(8))]
    assert [i["interfaceName"] for i in interfaces][-1] == "eth9"
    assert "initContainers" not in pod["spec"]
    assert {"name": "gib", "hostPath": {"path": "/home/kubernetes/bin/gib", "type": "Directory"}} in pod["spec"]["volumes"]

    kueue = spec_of("jobs/cluster-a4.yaml", "kuberay.kueue.queue=a4-high", "kuberay.kueue.priority_class=high")
    job = render_job(kueue, ["python", "-m", "a4ray.qwen3_next"]).main
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "a4-high"
    assert job["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "high"
    assert job["spec"]["suspend"] is True and job["spec"]["shutdownAfterJobFinishes"] is True
    worker = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["metadata"]["annotations"]
    assert worker["kueue.x-k8s.io/podset-preferred-topology"] == GKE_BLOCK_LABEL
    assert job["metadata"]["name"] == "qwen3-next"
    plain = render_job(spec_of("jobs/cluster-a4.yaml"), ["python", "-m", "a4ray.qwen3_next"]).main
    assert "suspend" not in plain["spec"] and "kueue.x-k8s.io/queue-name" not in plain["metadata"]["labels"]

    existing = render_job(spec_of("jobs/ddp_test.yaml"), ["python", "-m", "a4ray.ddp_test"], cluster="a4")
    assert existing.objects == [existing.main]
    assert existing.main["spec"]["clusterSelector"] == {"ray.io/cluster": "a4"}
    assert "rayClusterSpec" not in existing.main["spec"] and "shutdownAfterJobFinishes" not in existing.main["spec"]

    # Storage objects are named per release and namespace; the PVs are bound to the release's claims.
    lustre = spec_of("jobs/cluster-a4.yaml", *STORAGE["lustre"], "kuberay.namespace=team-a")
    pv, pvc, _ = render_cluster(lustre, name="exp1").objects
    assert pv["metadata"]["name"] == "team-a-exp1-lustre" and pvc["metadata"]["name"] == "exp1-lustre"
    assert pv["spec"]["claimRef"] == {"namespace": "team-a", "name": "exp1-lustre"}
    assert pv["spec"]["csi"]["volumeHandle"] == "p/us-central1-b/lfs"
    assert pvc["spec"]["volumeName"] == pv["metadata"]["name"] and pv["spec"]["persistentVolumeReclaimPolicy"] == "Retain"
    other = render_cluster(lustre, name="exp2").objects
    assert {o["metadata"]["name"] for o in other[:2]}.isdisjoint({pv["metadata"]["name"], pvc["metadata"]["name"]})


def test_no_secret_value_in_anything_rendered(monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", SECRET_VALUE)  # in the environment of whoever renders
    spec = spec_of("jobs/ddp_test.yaml", "kuberay.secrets[1].env=WANDB_API_KEY", "kuberay.secrets[1].secret=wandb",
                   "kuberay.secrets[1].key=key")
    for rendered in (render_cluster(spec), render_job(spec, default_entrypoint(spec, "jobs/ddp_test.yaml", []))):
        text = rendered.to_yaml()
        assert SECRET_VALUE not in text and "runtimeEnvYAML" not in text
        ray_env = {e["name"]: e for e in rendered.main["spec"].get("rayClusterSpec", rendered.main["spec"])
                   ["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["env"]}
        assert "value" not in ray_env["WANDB_API_KEY"] and "value" not in ray_env["HF_TOKEN"]
    # A secret put into the spec, or into the command, is refused without repeating it.
    for sets, command in (([f"network.env.HF_TOKEN={SECRET_VALUE}"], []),
                          ([], ["--", "env", f"HF_TOKEN={SECRET_VALUE}", "python", "-m", "a4ray.ddp_test"])):
        code = cli(["render", "job", "-f", "jobs/ddp_test.yaml", "--set", IMAGE, *(f"--set={s}" for s in sets),
                    *command])
        out = capsys.readouterr()
        assert code == 2 and "kuberay.secrets" in out.err
        assert SECRET_VALUE not in out.out + out.err


@pytest.mark.parametrize("sets, cluster, field", [
    (["cluster.gpus_per_node=4"], None, "cluster.gpus_per_node"),
    (["kuberay.worker.replica=3"], None, "kuberay.worker.replica"),
    (["kuberay.kueue.queue=a4-high"], "a4", "kuberay.kueue.queue"),
    (["kuberay.job.submission_mode=SidecarMode"], "a4", "kuberay.job.submission_mode"),
    (["cluster.machine_type=a3-highgpu-8g"], None, "cluster.machine_type"),
    (["kuberay.gib.image=us-docker.pkg.dev/gce-ai-infra/gpudirect-gib/nccl-plugin-gib:latest"], None,
     "kuberay.gib.image"),
])
def test_wrong_specs_fail_naming_the_field(sets, cluster, field, capsys):
    argv = ["render", "job", "-f", "jobs/cluster-a4.yaml", *[f"--set={s}" for s in sets]]
    argv += (["--cluster", cluster] if cluster else []) + ["--", "python", "-m", "a4ray.ddp_test"]
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert f"- {field}:" in err and "jobs/cluster-a4.yaml" in err


def test_names_over_kuberays_limits_are_refused():
    spec = spec_of("jobs/cluster-a4.yaml")
    with pytest.raises(SpecError, match=r"name: 'j{48}' is 48 characters; a KubeRay RayJob name has at most 47"):
        render_job(spec, ["true"], name="j" * 48)
    assert render_cluster(spec, name="c" * 53).main["metadata"]["name"] == "c" * 53
    with pytest.raises(SpecError, match="name: 'Exp_1' is not a DNS-1035 label"):
        render_cluster(spec, name="Exp_1")
    with pytest.raises(SpecError, match="at most 53"):
        render_cluster(spec, name="c" * 54)
    with pytest.raises(SpecError, match="kuberay.image: required"):
        render_cluster(load_job(REPO / "jobs/ddp_test.yaml"))
    with pytest.raises(SpecError, match="kuberay.auth.via: env cannot protect a RayJob"):
        render_job(spec.set("kuberay.auth.via", "env"), ["true"])
    with pytest.raises(SpecError, match="kuberay.auth.via: operator, but the installed KubeRay"):
        render_cluster(spec.set("kuberay.auth.via", "operator"), caps=OperatorCaps(auth_options=False))


def test_operator_and_api_server_checks_on_manifests():
    """Manifests KubeRay's validation.go, the API server or Kueue refuse, each with its path named."""
    good_cluster = render_cluster(spec_of("jobs/cluster-a4.yaml")).main
    good_job = render_job(spec_of("jobs/cluster-a4.yaml", "kuberay.kueue.queue=q"), ["true"]).main
    assert validate.manifest_problems(good_cluster) == [] and validate.manifest_problems(good_job) == []

    def broken(obj, edit):
        obj = json.loads(json.dumps(obj))
        edit(obj)
        return validate.manifest_problems(obj)

    group = lambda o: o["spec"]["workerGroupSpecs"][0]  # noqa: E731
    cases = [
        (good_cluster, lambda o: group(o).update(replicas="two"), "spec.workerGroupSpecs[0].replicas: 'two' is not"),
        (good_cluster, lambda o: group(o).update(replica=2), "unknown field(s) ('replica' was unexpected)"),
        (good_cluster, lambda o: group(o).update(replicas=2**31), "spec.workerGroupSpecs[0].replicas: 2147483648"),
        (good_cluster, lambda o: group(o)["rayStartParams"].update({"num-gpus": 8}), "8 is not of type 'string'"),
        (good_cluster, lambda o: group(o)["rayStartParams"].update(labels="a=b"), "rayStartParams.labels: not"),
        (good_cluster, lambda o: group(o)["rayStartParams"].update({"num-gpus": "8"}), "both rayStartParams"),
        (good_cluster, lambda o: group(o).update(minReplicas=3), "minReplicas 3 is greater than maxReplicas 2"),
        (good_cluster, lambda o: group(o).pop("maxReplicas"), "must both be set"),
        (good_cluster, lambda o: o["spec"].update(rayVersion="2.51.0"), "needs Ray >= 2.52.0"),
        (good_cluster, lambda o: o["metadata"].update(name="A4"), "not a DNS-1035 label"),
        (good_cluster, lambda o: group(o)["template"]["spec"].update(containers=[]), "at least one container"),
        (good_job, lambda o: o["spec"].update(shutdownAfterJobFinishes=False), "spec.suspend: a RayJob can be"),
        (good_job, lambda o: o["spec"].update(clusterSelector={"ray.io/cluster": "a4"}), "exactly one of"),
        (good_job, lambda o: o["spec"].update(submissionMode="Batch"), "spec.submissionMode: 'Batch'"),
        (good_job, lambda o: o["spec"].update(suspend=False), "must be true so Kueue admits"),
        (good_job, lambda o: o["spec"].update(runtimeEnvYAML="a: [b"), "spec.runtimeEnvYAML: not valid YAML"),
    ]
    for obj, edit, expected in cases:
        problems = broken(obj, edit)
        assert any(expected in p for p in problems), (expected, problems)
    # A bare `metadata:` (null) in a pod template is pruned by the API server, not an error.
    assert broken(good_cluster, lambda o: group(o)["template"].update(metadata=None)) == []
    with pytest.raises(ManifestInvalid, match="RayCluster a4 would be refused"):
        bad = json.loads(json.dumps(good_cluster))
        group(bad)["replicas"] = -1
        group(bad)["minReplicas"] = -1
        validate.check_manifest(bad)


def test_kuberay_dir_is_what_a4ray_render_produces(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    lines = [line for line in (REPO / "kuberay/manifests.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    produced = set()
    for line in lines:
        file, _, args = line.partition(": ")
        what, *rest = shlex.split(args)
        out = tmp_path / file
        assert cli(["render", what, "-o", str(out), *rest]) == 0, line
        assert out.read_text() == (REPO / "kuberay" / file).read_text(), f"kuberay/{file} is stale: make kuberay"
        produced.add(file)
    assert produced == {p.name for p in (REPO / "kuberay").iterdir() if p.suffix in (".yaml", ".json")}
    assert {"raycluster-a4-2node.yaml", "raycluster-a4-4node.yaml", "rayjob-qwen3-next.yaml",
            "rayjob-nccl-test.yaml", "rayjob-deepep-test.yaml"} <= produced
    four = yaml.safe_load((REPO / "kuberay/raycluster-a4-4node.yaml").read_text())
    assert four["spec"]["workerGroupSpecs"][0]["replicas"] == 4
    qwen = yaml.safe_load((REPO / "kuberay/rayjob-qwen3-next.yaml").read_text())
    assert qwen["spec"]["entrypoint"].startswith("python -m a4ray.qwen3_next")
    # The Ray dashboard's Metrics page: the head names Prometheus and Grafana (Ray reads these at its start) ...
    head_env = {e["name"]: e.get("value") for e in
                four["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]}
    assert head_env["RAY_GRAFANA_HOST"].startswith("http://") and head_env["RAY_PROMETHEUS_HOST"].startswith("http://")
    # ... and a4ray's charts ship as the ConfigMap Grafana's dashboard sidecar loads (its label), holding the JSON.
    charts = yaml.safe_load((REPO / "kuberay/a4ray-grafana-dashboard.yaml").read_text())
    assert charts["kind"] == "ConfigMap" and charts["metadata"]["labels"] == {"grafana_dashboard": "1"}
    dashboard = json.loads((REPO / "kuberay/a4ray-grafana-dashboard.json").read_text())
    assert json.loads(charts["data"]["a4ray_grafana_dashboard.json"]) == dashboard
    titles = {panel["title"] for panel in dashboard["panels"]}
    assert {"Loss", "Tokens per second", "Step time per node", "Stragglers", "Hang culprits", "Staging throughput",
            "Conversion throughput"} <= titles
