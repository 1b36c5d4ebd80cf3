"""`a4ray render | up | down | status | submit | logs`: job specs as KubeRay objects on a GKE cluster.

    a4ray render cluster -f jobs/cluster-a4.yaml --set cluster.nodes=4 [-o FILE]
    a4ray render job -f jobs/cluster-a4.yaml -- python -m a4ray.qwen3_next --config jobs/qwen3_next.yaml
    a4ray up -f jobs/cluster-a4.yaml            create the RayCluster (and its storage), wait for the head
    a4ray submit -f jobs/ddp_test.yaml --cluster a4     run a job on it through Ray's job API
    a4ray submit -f jobs/ddp_test.yaml          a RayJob with its own cluster (deleted when the job ends)
    a4ray logs a4 | a4ray status | a4ray down a4

Every command that changes the cluster takes --dry-run: it prints the API calls and manifests instead.
"""

from __future__ import annotations

import argparse
import shlex
import time

from a4ray.commands import summary
from a4ray.core.console import say, table, warn
from a4ray.core.errors import A4RayError, KubeError
from a4ray.driver.main import error_exit
from a4ray.k8s.render import (
    BUNDLED,
    GRAFANA_NAMESPACE,
    default_entrypoint,
    grafana_dashboard_configmap,
    job_name,
    render_cluster,
    render_job,
    to_yaml,
)
from a4ray.observe import grafana
from a4ray.runtime.connect import submit_job
from a4ray.spec.loader import load_job


def _spec_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("-f", "--config", required=True, metavar="FILE", help="job spec YAML (any kind)")
    p.add_argument("--set", action="append", default=[], metavar="A.B.C=VALUE", help="override a spec field")
    p.add_argument("--name", help="object name (default: the spec's name)")


def _kube_options(p: argparse.ArgumentParser, namespace: bool = False) -> None:
    p.add_argument("--context", help="kubeconfig context (default: the current one)")
    if namespace:
        p.add_argument("-n", "--namespace", default="default", help="Kubernetes namespace (default: %(default)s)")


def _command(p: argparse.ArgumentParser) -> None:
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD",
                   help="the job's command (default: python -m a4ray.<kind> --config FILE --set ...)")


def add_cli(sub: argparse._SubParsersAction) -> None:
    render = sub.add_parser("render", help=summary("render")).add_subparsers(
        dest="what", required=True)
    cluster = render.add_parser("cluster", help="a RayCluster")
    job = render.add_parser("job", help="a RayJob (its own cluster, or --cluster NAME)")
    for p in (cluster, job):
        _spec_options(p)
        p.add_argument("-o", "--output", metavar="FILE", help="write the manifest here instead of stdout")
    job.add_argument("--cluster", metavar="NAME", help="run on this existing RayCluster (clusterSelector)")
    _command(job)
    cluster.set_defaults(func=_render)
    job.set_defaults(func=_render)
    charts = render.add_parser("grafana", help="a4ray's Grafana dashboard: a ConfigMap Grafana's sidecar loads, or "
                               "its JSON (--format json) to import")
    charts.add_argument("--format", choices=("configmap", "json"), default="configmap",
                        help="configmap: for Grafana's dashboard sidecar (labelled grafana_dashboard); json: the "
                        "dashboard itself, to import by hand (default: %(default)s)")
    charts.add_argument("-n", "--namespace", default=GRAFANA_NAMESPACE, help="Grafana's namespace (default: "
                        "%(default)s, as KubeRay's Prometheus/Grafana guide installs it)")
    charts.add_argument("-o", "--output", metavar="FILE", help="write it here instead of stdout")
    charts.set_defaults(func=_render_grafana)

    up = sub.add_parser("up", help=summary("up"))
    _spec_options(up)
    _kube_options(up)
    up.add_argument("--timeout", type=float, default=1800, help="seconds to wait for the cluster (default 1800)")
    up.add_argument("--no-wait", action="store_true", help="return once the objects are created")
    up.add_argument("--dry-run", action="store_true", help="print the API calls and manifests; change nothing")
    up.set_defaults(func=_up)

    down = sub.add_parser("down", help=summary("down"))
    down.add_argument("name", help="the RayCluster (or with --job, the RayJob) to delete")
    down.add_argument("--job", action="store_true", help="NAME is a RayJob")
    down.add_argument("--keep-storage", action="store_true", help="keep the PV/PVCs a4ray created")
    _kube_options(down, namespace=True)
    down.add_argument("--dry-run", action="store_true", help="print the API calls it would make; delete nothing")
    down.set_defaults(func=_down)

    status = sub.add_parser("status", help=summary("status"))
    status.add_argument("name", nargs="?", help="one RayCluster or RayJob (default: all of a4ray's)")
    _kube_options(status, namespace=True)
    status.add_argument("--dry-run", action="store_true", help="print the API calls it would make")
    status.set_defaults(func=_status)

    submit = sub.add_parser("submit", help=summary("submit"))
    _spec_options(submit)
    _kube_options(submit)
    submit.add_argument("--cluster", metavar="NAME", help="submit to this RayCluster through Ray's job API")
    submit.add_argument("--no-follow", action="store_true", help="return once submitted")
    submit.add_argument("--timeout", type=float, default=3600, help="seconds to wait for a RayJob's cluster")
    submit.add_argument("--dry-run", action="store_true", help="print the API calls and manifests; submit nothing")
    _command(submit)
    submit.set_defaults(func=_submit)

    logs = sub.add_parser("logs", help=summary("logs"))
    logs.add_argument("name", help="a RayJob, or a RayCluster (then --job-id, default: its latest job)")
    logs.add_argument("--job-id", help="Ray job submission id")
    logs.add_argument("--follow", action="store_true", help="keep printing until the job ends")
    _kube_options(logs, namespace=True)
    logs.add_argument("--dry-run", action="store_true", help="say what it would read, and from where")
    logs.set_defaults(func=_logs)


# ----------------------------------------------------------------------------------------- helpers


def _main(fn):
    """Errors become one clear message and a non-zero exit, as in every a4ray command."""

    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except A4RayError as error:
            return error_exit(error)

    return run


def _load(args: argparse.Namespace):
    return load_job(args.config, args.set)


def _entrypoint(args: argparse.Namespace, spec) -> list[str]:
    command = list(args.command or [])
    if command[:1] == ["--"]:
        command = command[1:]
    return command or default_entrypoint(spec, args.config, args.set)


def _connect(args: argparse.Namespace):
    from a4ray.k8s.client import Kube

    return Kube.connect(args.context)


def _warn_all(rendered) -> None:
    for line in rendered.warnings:
        warn(line)


# ---------------------------------------------------------------------------------------- commands


def _render_grafana(args: argparse.Namespace) -> int:
    text = (grafana.dashboard_json() if args.format == "json"
            else to_yaml([grafana_dashboard_configmap(args.namespace)]))
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
        say(f"wrote a4ray's Grafana dashboard ({args.format}) to {args.output}")
    else:
        print(text, end="", flush=True)
    return 0


@_main
def _render(args: argparse.Namespace) -> int:
    spec = _load(args)
    if args.what == "cluster":
        rendered = render_cluster(spec, name=args.name)
    else:
        rendered = render_job(spec, _entrypoint(args, spec), name=args.name, cluster=args.cluster)
    _warn_all(rendered)
    if args.output:
        with open(args.output, "w") as f:
            f.write(rendered.to_yaml())
        say(f"wrote {rendered.main['kind']} {rendered.main['metadata']['name']} to {args.output}")
    else:
        print(rendered.to_yaml(), end="", flush=True)
    return 0


def up_calls(spec, *, name: str | None = None, caps=None) -> tuple[list, object]:
    """The API calls of `a4ray up` (token Secret if auth goes via env, storage, RayCluster), and the render."""
    from a4ray.k8s.client import create_calls, token_secret
    rendered = render_cluster(spec, name=name, caps=caps or BUNDLED)
    objects = list(rendered.objects)
    ray_env = rendered.main["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
    token_ref = next((e["valueFrom"]["secretKeyRef"] for e in ray_env if e["name"] == "RAY_AUTH_TOKEN"), None)
    if token_ref and not spec.kuberay.auth.secret:
        # a4ray names this Secret, so a4ray makes it; a named one is the user's to provide.
        objects.insert(0, token_secret(token_ref["name"], spec.kuberay.namespace, rendered.main["metadata"]["name"]))
    return create_calls(objects), rendered


@_main
def _up(args: argparse.Namespace) -> int:
    from a4ray.k8s.client import print_plan

    spec = _load(args)
    if args.dry_run:
        calls, rendered = up_calls(spec, name=args.name)
        _warn_all(rendered)
        print_plan(calls)
        return 0
    kube = _connect(args)
    caps = kube.caps()
    if not caps.auth_options and spec.kuberay.auth.mode == "token":
        say("the installed KubeRay has no authOptions: the Ray token goes to every Ray container from a Secret")
    calls, rendered = up_calls(spec, name=args.name, caps=caps)
    _warn_all(rendered)
    name, namespace = rendered.main["metadata"]["name"], spec.kuberay.namespace
    if kube.get("RayCluster", name, namespace) is not None:
        raise KubeError(f"RayCluster {namespace}/{name} already exists",
                        hint=f"`a4ray status {name}`; `a4ray down {name}` to replace it, or --name another")
    kube.run_all(calls)
    if args.no_wait:
        return 0
    kube.wait_ready(name, namespace, args.timeout)
    say(f"RayCluster {namespace}/{name} is ready. Next: a4ray submit -f SPEC --cluster {name}; "
        f"a4ray logs {name}; a4ray down {name}")
    return 0


@_main
def _down(args: argparse.Namespace) -> int:
    from a4ray.k8s.client import delete_calls, print_plan

    calls = delete_calls("RayJob" if args.job else "RayCluster", args.name, args.namespace,
                         keep_storage=args.keep_storage)
    if args.dry_run:
        print_plan(calls)
        return 0
    _connect(args).run_all(calls)
    return 0


@_main
def _status(args: argparse.Namespace) -> int:
    from a4ray.k8s.client import cluster_summary, job_summary, list_call, print_plan

    if args.dry_run:
        print_plan([list_call(kind, args.namespace) for kind in ("RayCluster", "RayJob")])
        return 0
    kube = _connect(args)
    rows = []
    for kind, summarize in (("RayCluster", cluster_summary), ("RayJob", job_summary)):
        for obj in kube.list(kind, args.namespace):
            if args.name and obj["metadata"]["name"] != args.name:
                continue
            rows.append([kind, obj["metadata"]["name"], summarize(obj), obj["metadata"].get("creationTimestamp", "")])
    if not rows:
        say(f"no a4ray RayClusters or RayJobs{' named ' + args.name if args.name else ''} in {args.namespace}")
        return 1 if args.name else 0
    print(table(f"namespace {args.namespace}", ["kind", "name", "state", "created"], rows), flush=True)
    return 0


def submit_to_cluster(client, entrypoint: list[str], *, name: str) -> str:
    """Submit `entrypoint` through Ray's job API; returns the submission id."""
    return submit_job(client, entrypoint=shlex.join(entrypoint), submission_id=f"{name}-{int(time.time())}",
                      metadata={"a4ray": "true", "a4ray.job": name})


@_main
def _submit(args: argparse.Namespace) -> int:
    from a4ray.k8s.client import create_calls, dashboard, follow_logs, print_plan
    spec = _load(args)
    entrypoint = _entrypoint(args, spec)
    namespace = spec.kuberay.namespace
    if args.cluster:
        name = job_name(spec, entrypoint, args.name)
        if args.dry_run:
            say(f"would submit to RayCluster {namespace}/{args.cluster} (port-forward to its head's dashboard, "
                f"token from its Secret): {shlex.join(entrypoint)}")
            return 0
        with dashboard(_connect(args), args.cluster, namespace) as (client, _):
            job_id = submit_to_cluster(client, entrypoint, name=name)
            say(f"submitted {job_id} to {args.cluster}; logs: a4ray logs {args.cluster} --job-id {job_id} --follow")
            if args.no_follow:
                return 0
            final = follow_logs(client, job_id, lambda text: print(text, end="", flush=True))
        if final is None:
            return _detached(job_id, f"a4ray logs {args.cluster} --job-id {job_id} --follow",
                             f"ray job stop {job_id} (through the dashboard, as ray job submit reaches it)")
        say(f"job {job_id}: {final}")
        return 0 if final == "SUCCEEDED" else 1
    if args.dry_run:
        rendered = render_job(spec, entrypoint, name=args.name)
        _warn_all(rendered)
        print_plan(create_calls(rendered.objects))
        return 0
    kube = _connect(args)
    rendered = render_job(spec, entrypoint, name=args.name, caps=kube.caps())
    _warn_all(rendered)
    name = rendered.main["metadata"]["name"]
    if kube.get("RayJob", name, namespace) is not None:
        raise KubeError(f"RayJob {namespace}/{name} already exists",
                        hint=f"`a4ray down --job {name}` first, or --name another")
    kube.run_all(create_calls(rendered.objects))
    if args.no_follow:
        say(f"RayJob {namespace}/{name} created; a4ray logs {name} --follow; a4ray status {name}")
        return 0
    return _follow_rayjob(kube, name, namespace, args.timeout)


def _detached(job: str, follow: str, stop: str) -> int:
    """Ctrl-C while following a job's logs: the job goes on; say how to follow it again and how to stop it."""
    say(f"stopped following {job}; it goes on: `{follow}` follows it again, `{stop}` stops it")
    return 130  # the shell's code for an end by SIGINT


def _follow_rayjob(kube, name: str, namespace: str, timeout_s: float) -> int:
    from a4ray.k8s.client import dashboard, follow_logs

    obj = kube.wait_submitted(name, namespace, timeout_s)
    status = obj.get("status") or {}
    if status.get("jobDeploymentStatus") != "Running":
        say(f"RayJob {name}: {status.get('jobDeploymentStatus')} {status.get('jobStatus', '')}")
        return 0 if status.get("jobStatus") == "SUCCEEDED" else 1
    with dashboard(kube, status["rayClusterName"], namespace) as (client, _):
        final = follow_logs(client, status["jobId"], lambda text: print(text, end="", flush=True))
    if final is None:
        return _detached(f"RayJob {namespace}/{name}", f"a4ray logs {name} --follow", f"a4ray down --job {name}")
    say(f"RayJob {name}: job {final}")
    return 0 if final == "SUCCEEDED" else 1


@_main
def _logs(args: argparse.Namespace) -> int:
    from a4ray.k8s.client import dashboard, follow_logs

    if args.dry_run:
        say(f"would read RayJob (else RayCluster) {args.namespace}/{args.name}, port-forward to its head pod's "
            f"dashboard with the cluster's token, and {'follow' if args.follow else 'print'} the logs of job "
            f"{args.job_id or '<its job id, or the latest>'}")
        return 0
    kube = _connect(args)
    cluster, job_id = args.name, args.job_id
    rayjob = kube.get("RayJob", args.name, args.namespace)
    if rayjob is not None:
        status = rayjob.get("status") or {}
        if not status.get("rayClusterName") or not status.get("jobId"):
            raise KubeError(f"RayJob {args.namespace}/{args.name} has not started its job yet",
                            hint=f"a4ray status {args.name}")
        cluster, job_id = status["rayClusterName"], job_id or status["jobId"]
    with dashboard(kube, cluster, args.namespace) as (client, _):
        if job_id is None:
            jobs = sorted(client.list_jobs(), key=lambda j: j.start_time or 0)
            if not jobs:
                raise KubeError(f"RayCluster {args.namespace}/{cluster} has run no jobs")
            job_id = jobs[-1].submission_id
            say(f"latest job on {cluster}: {job_id}")
        if args.follow:
            final = follow_logs(client, job_id, lambda t: print(t, end="", flush=True))
            if final is None:
                return _detached(job_id, f"a4ray logs {args.name} --job-id {job_id} --follow",
                                 f"ray job stop {job_id}")
            say(f"job {job_id}: {final}")
        else:
            print(client.get_job_logs(job_id), end="", flush=True)
    return 0
