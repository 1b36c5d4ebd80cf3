"""Staging: real sources (huggingface_hub against a local Hub-compatible endpoint, ranged GETs against a
local HTTP server that drops connections, file copies, git), on the session's multi-node local Ray cluster.

The Hub and the internet cannot be reached from here: `tests/localserver.py` stands in for the Hub (the
same API routes and headers `snapshot_download` reads) and for a plain HTTPS file server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import ray

from a4ray.core.errors import SpecError, StagingFailed
from a4ray.spec import ArtifactSpec, StageJob, load_job
from a4ray.staging import stage
from a4ray.staging.display import Display
from a4ray.staging.layout import MANIFEST, ArtifactPaths, Manifest
from a4ray.staging.service import get_service
from a4ray.staging import stager
from a4ray.staging.stager import unshared_error
from conftest import PYTHON, REPO, run_to_end, seed_standins
from localserver import LocalServer, Repo

SENTINEL = "hf_SENTINEL_b6f1c0ffee_do_not_log"
QUIET = Display(every_s=3600, tty=False)


def stage_job(tmp_path: Path, *artifacts: dict, **staging) -> StageJob:
    return StageJob(artifacts=[ArtifactSpec(**a) for a in artifacts], staging=staging,
                    storage={"local_workspace": str(tmp_path / "ws")})


def published(result, name: str) -> Path:
    return Path(next(a.target for a in result.artifacts if a.name == name))


@pytest.fixture
def server():
    s = LocalServer().start()
    yield s
    s.stop()


def tiny_repo(token: str | None = None) -> Repo:
    weights = bytes(range(256)) * 800  # 200 KB: an LFS file, listed with its sha256
    return Repo({"config.json": b'{"model_type": "qwen3_moe"}', "model.safetensors": weights,
                 "tokenizer.json": b'{"version": "1.0"}', "README.md": b"# tiny"}, token=token)


# ------------------------------------------------------------------------------------------ specs


def test_bad_specs_name_the_field_and_what_to_do(tmp_path):
    def load(source: str, **extra):
        spec = {"kind": "stage", "artifacts": [{"name": "m", "source": source, "target": "x", **extra}]}
        path = tmp_path / "s.yaml"
        path.write_text(json.dumps(spec))
        return load_job(path)

    cases = {
        "s3://bucket/x": "unknown scheme 's3://'",
        "git+https://github.com/alibaba/Pai-Megatron-Patch.git": "must pin a commit",
        "git+https://github.com/alibaba/Pai-Megatron-Patch.git@main": "'main' is not a full commit SHA",
        "hf://Qwen/Qwen3-Next-80B-A3B-Instruct@": "missing revision after '@'",
        "hf://Qwen": "takes <org>/<repo>",
        "https://host/dir/": "list the files to fetch under `files:`",
    }
    for source, expected in cases.items():
        with pytest.raises(SpecError) as e:
            load(source)
        assert "artifacts[0]" in str(e.value) and expected in str(e.value), str(e.value)
    with pytest.raises(SpecError, match="not a 64-hex sha256"):
        load("https://host/f.bin", sha256={"f.bin": "abc"})
    overlapping = ["artifacts[0].name=a", "artifacts[0].source=/x", "artifacts[0].target=m",
                   "artifacts[1].name=b", "artifacts[1].source=/y", "artifacts[1].target=m/sub"]
    with pytest.raises(SpecError, match="targets overlap: 'a' \\(m\\) and 'b' \\(m/sub\\)"):
        load_job(None, overlapping, kind="stage")
    with pytest.raises(SpecError, match="token_file: must be an absolute path"):
        load_job(None, ["staging.token_file=token.txt"], kind="stage")
    with pytest.raises(SpecError, match="staging.hf_token: unknown field") as e:  # a token never goes in a spec
        load_job(None, [f"staging.hf_token={SENTINEL}"], kind="stage")
    assert SENTINEL not in str(e.value)


def test_unshared_workspace_is_refused_naming_the_nodes():
    error = unshared_error(Path("/tmp/ws"), "node-a", [("node-b", True), ("node-c", False)], job_nodes=3)
    assert error is not None
    text = str(error)
    assert "/tmp/ws is not shared storage" in text and "node-c" in text and "node-b" not in text.split("hint")[0]
    assert "storage.workspace" in text
    assert unshared_error(Path("/tmp/ws"), "node-a", [("node-b", True)], job_nodes=2) is None


# ------------------------------------------------------------------------------------------ hf://


def test_hf_snapshot_from_local_hub_with_secret_token(local_cluster, server, tmp_path, capfd):
    """The real snapshot_download against the local Hub stand-in; the token (a sentinel) is read from a
    token file on the nodes, sent to the Hub, and found nowhere else: not in results, manifests, the
    driver's output, errors, or any Ray log."""
    server.repos["tiny/qwen3-moe"] = tiny_repo(token=SENTINEL)
    token_file = tmp_path / "secret" / "token"
    token_file.parent.mkdir()
    token_file.write_text(SENTINEL + "\n")
    spec = stage_job(tmp_path, {"name": "tiny-moe", "source": "hf://tiny/qwen3-moe", "target": "ckpts/tiny",
                                "exclude": ["README.md"]},
                     token_file=str(token_file), hf_endpoint=server.url)

    first = stage(spec, display=QUIET)
    (outcome,) = first.artifacts
    target = published(first, "tiny-moe")
    repo = server.repos["tiny/qwen3-moe"]
    assert outcome.status == "ran" and outcome.resolved == repo.commit
    assert sorted(p.name for p in target.iterdir()) == sorted([MANIFEST, "config.json", "model.safetensors",
                                                                "tokenizer.json"])
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (target / name).read_bytes() == repo.files[name]
    manifest = Manifest.model_validate_json((target / MANIFEST).read_text())
    assert {f.path for f in manifest.files} == {"config.json", "model.safetensors", "tokenizer.json"}
    assert not (target / ".cache").exists() and not ArtifactPaths(target).partial.exists()
    assert any(r.authorization == f"Bearer {SENTINEL}" for r in server.log)
    assert server.gets("/model.safetensors") == 1

    again = stage(spec, display=QUIET)
    assert again.artifacts[0].status == "cached" and again.artifacts[0].manifest_sha256 == outcome.manifest_sha256
    assert server.gets("/model.safetensors") == 1  # a cache hit asks nothing of the source

    # A wrong token (also a secret): 401, a clear error naming the artifact, nothing published.
    token_file.write_text("hf_WRONG_token_0123456789")
    wrong = spec.set("artifacts[0].target", "ckpts/tiny-2")
    with pytest.raises(StagingFailed) as e:
        stage(wrong, display=QUIET)
    message = str(e.value)
    assert "tiny-moe" in message and "not found or not authorized (HTTP 401)" in message
    assert "hf_WRONG_token" not in message
    assert not (tmp_path / "ws" / "ckpts" / "tiny-2").exists()
    missing = spec.set("artifacts[0].source", "hf://tiny/no-such-repo").set("artifacts[0].target", "ckpts/x")
    with pytest.raises(StagingFailed, match="HTTP 404"):
        stage(missing, display=QUIET)

    texts = [first.model_dump_json(), again.model_dump_json(), (target / MANIFEST).read_text(), message,
             "".join(capfd.readouterr())]
    session_logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    texts += [p.read_text(errors="replace") for p in session_logs.rglob("*")
              if p.is_file() and p.stat().st_size < 2**24]
    assert not [t for t in texts if SENTINEL in t or "hf_WRONG_token" in t]


# ---------------------------------------------------------------------------------------- https://


def test_https_resumes_a_dropped_connection_with_ranged_gets(local_cluster, server, tmp_path):
    data = os.urandom(3 * 2**20)
    server.files["pai/mmap.bin"] = data
    server.files["pai/mmap.idx"] = b"idx" * 100
    server.drops["pai/mmap.bin"], server.drop_after["pai/mmap.bin"] = 2, 2**20  # two GETs die after 1 MiB
    import hashlib

    spec = stage_job(tmp_path, {"name": "mmap", "source": f"{server.url}/files/pai/", "target": "datasets/mmap",
                                "files": ["mmap.bin", "mmap.idx"],
                                "sha256": {"mmap.bin": hashlib.sha256(data).hexdigest()}})
    result = stage(spec, display=QUIET)
    target = published(result, "mmap")
    assert (target / "mmap.bin").read_bytes() == data
    ranges = [r.range for r in server.log if r.method == "GET" and r.path.endswith("mmap.bin")]
    offsets = [int(r.removeprefix("bytes=").rstrip("-")) for r in ranges[1:]]
    assert ranges[0] is None and len(offsets) == 2 and 0 < offsets[0] < offsets[1] < len(data), ranges
    manifest = Manifest.model_validate_json((target / MANIFEST).read_text())
    assert {f.path: f.sha256 for f in manifest.files}["mmap.bin"] == hashlib.sha256(data).hexdigest()


def test_bad_sources_and_targets_fail_clearly_and_publish_nothing(local_cluster, server, tmp_path):
    server.files["huge.bin"] = b"x" * 1000
    server.claimed_sizes["huge.bin"] = 10**18
    cases = [
        ({"source": f"{server.url}/files/huge.bin"}, "needs 1000000.0 TB more"),
        ({"source": f"{server.url}/files/gone.bin"}, "answered HTTP 404"),
        ({"source": str(tmp_path / "nowhere")}, "does not exist"),
    ]
    for i, (artifact, expected) in enumerate(cases):
        spec = stage_job(tmp_path, {"name": f"bad-{i}", "target": f"bad/{i}", **artifact})
        with pytest.raises(StagingFailed) as e:
            stage(spec, display=QUIET)
        assert f"artifact 'bad-{i}'" in str(e.value) and expected in str(e.value), str(e.value)
        assert not (tmp_path / "ws" / "bad" / str(i)).exists()

    # A target that a4ray did not stage, or that changed after staging, is not overwritten silently.
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.json").write_text("{}")
    spec = stage_job(tmp_path, {"name": "plain", "source": str(src), "target": "plain"})
    (tmp_path / "ws" / "plain").mkdir(parents=True)
    (tmp_path / "ws" / "plain" / "old.txt").write_text("by hand")
    with pytest.raises(StagingFailed, match="has no a4ray manifest"):
        stage(spec, display=QUIET)
    result = stage(spec.set("staging.replace", True), display=QUIET)
    assert sorted(p.name for p in published(result, "plain").iterdir()) == [MANIFEST, "a.json"]
    (published(result, "plain") / "a.json").write_text('{"edited": 1}')
    with pytest.raises(StagingFailed, match="a.json .* changed since it was staged"):
        stage(spec, display=QUIET)


# ------------------------------------------------------------------------------------------- git


def test_git_checkout_is_pinned_and_verified(local_cluster, tmp_path):
    repo = tmp_path / "upstream"
    repo.mkdir()
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "run.sh").write_text("echo 1\n")
    subprocess.run([*git, "-C", str(repo), "add", "."], check=True)
    subprocess.run([*git, "-C", str(repo), "commit", "-qm", "one"], check=True)
    first = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    (repo / "run.sh").write_text("echo 2\n")
    subprocess.run([*git, "-C", str(repo), "commit", "-qam", "two"], check=True)

    spec = stage_job(tmp_path, {"name": "patch", "source": f"git+file://{repo}@{first}",
                                "target": "Pai-Megatron-Patch"})
    result = stage(spec, display=QUIET)
    target = published(result, "patch")
    assert (target / "run.sh").read_text() == "echo 1\n"  # the pinned commit, not the branch head
    head = subprocess.run(["git", "-C", str(target), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert head.strip() == first == result.artifacts[0].resolved
    (target / "run.sh").write_text("sed -i patched\n")  # the seeds' in-place edits are caught
    with pytest.raises(StagingFailed, match="run.sh .* changed since it was staged"):
        stage(spec, display=QUIET)


# ------------------------------------------------------------------------ exactly once, resume


@pytest.mark.slow
def test_two_ray_jobs_staging_the_same_model_download_it_once(local_cluster, server, tmp_path):
    server.repos["tiny/qwen3-next"] = tiny_repo()
    server.rate = 100 * 1024  # 2 s for the weights: both jobs are in flight together
    spec = {"kind": "stage", "name": "twice", "storage": {"local_workspace": str(tmp_path / "ws")},
            "staging": {"hf_endpoint": server.url},
            "artifacts": [{"name": "tiny-next", "source": "hf://tiny/qwen3-next", "target": "ckpts/next"}]}
    (tmp_path / "spec.yaml").write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    drivers = [subprocess.Popen([PYTHON, "-m", "a4ray.stage", "-f", str(tmp_path / "spec.yaml"), "--address",
                                 local_cluster.address, "--result", str(tmp_path / f"r{i}.json")],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for i in range(2)]
    outputs = [d.communicate(timeout=300)[0] for d in drivers]
    assert [d.returncode for d in drivers] == [0, 0], outputs
    results = [json.loads((tmp_path / f"r{i}.json").read_text())["artifacts"][0] for i in range(2)]
    assert sorted(r["status"] for r in results) in (["joined", "ran"], ["cached", "ran"])
    assert results[0]["manifest_sha256"] == results[1]["manifest_sha256"]
    assert results[0]["manifest"] == results[1]["manifest"]
    assert server.gets("/model.safetensors") == 1 and server.gets("/config.json") == 1


@pytest.mark.slow
def test_a_killed_staging_task_publishes_nothing_and_the_rerun_resumes(local_cluster, server, tmp_path):
    import hashlib

    data = os.urandom(4 * 2**20)
    server.files["big.bin"] = data
    server.rate = 1 * 2**20  # 4 s: time to kill it mid-file
    spec = stage_job(tmp_path, {"name": "big", "source": f"{server.url}/files/big.bin", "target": "big"},
                     retries=0)
    target = tmp_path / "ws" / "big"
    failure: list[BaseException] = []
    thread = threading.Thread(target=lambda: _catch(failure, lambda: stage(spec, display=QUIET)))
    thread.start()
    service = get_service()
    progress = None
    for _ in range(600):
        snaps = ray.get(service.snapshot.remote([str(target)]))
        if snaps and snaps[0].phase == "downloading" and snaps[0].bytes > 2**20:
            progress = snaps[0]
            break
        time.sleep(0.05)
    assert progress is not None and progress.pid
    os.kill(progress.pid, signal.SIGKILL)  # the staging task's worker process, on its simulated node
    thread.join(timeout=120)
    assert failure and isinstance(failure[0], StagingFailed)
    assert "the staging task died" in str(failure[0]) and "'big'" in str(failure[0])
    assert not target.exists()
    partial = ArtifactPaths(target).partial
    kept = (partial / "big.bin.a4ray-part").stat().st_size
    assert kept >= 2**20

    server.rate = None
    result = stage(spec, display=QUIET)
    (outcome,) = result.artifacts
    assert outcome.status == "ran" and outcome.resumed_bytes == kept
    assert (target / "big.bin").read_bytes() == data
    assert [r.range for r in server.log if r.method == "GET"][-1] == f"bytes={kept}-"
    sha = {f.path: f.sha256 for f in Manifest.model_validate_json((target / MANIFEST).read_text()).files}
    assert sha["big.bin"] == hashlib.sha256(data).hexdigest()


@pytest.mark.slow
def test_losing_the_staging_service_mid_download_resumes_with_a_new_one(local_cluster, server, tmp_path):
    data = os.urandom(3 * 2**20)
    server.files["shard.bin"] = data
    server.rate = 1 * 2**20
    spec = stage_job(tmp_path, {"name": "shard", "source": f"{server.url}/files/shard.bin", "target": "shard"})
    target = tmp_path / "ws" / "shard"
    results: list = []
    thread = threading.Thread(target=lambda: _catch(results, lambda: results.append(stage(spec, display=QUIET))))
    thread.start()
    service = get_service()
    for _ in range(600):
        snaps = ray.get(service.snapshot.remote([str(target)]))
        if snaps and snaps[0].bytes > 2**20:
            break
        time.sleep(0.05)
    holder = int((tmp_path / "ws" / ".shard.a4ray-lock").read_text().split(" pid ")[1].split()[0])
    ray.kill(service)  # the owner of the staging dies; its task dies with it
    # Ray kills the orphaned task's worker soon, not at once: the old download stays slow until it is gone, so
    # it cannot finish the file first (that outcome, `cached`, would be right too, but would show no resume).
    _wait_gone(holder, timeout=60)
    server.rate = None
    thread.join(timeout=120)
    assert len(results) == 1 and not isinstance(results[0], BaseException), results
    (outcome,) = results[0].artifacts
    assert outcome.status == "ran" and outcome.resumed_bytes >= 2**20  # a new service resumed the partial file
    assert (target / "shard.bin").read_bytes() == data
    ranges = [r.range for r in server.log if r.method == "GET"]
    assert ranges[0] is None and all(r and r.startswith("bytes=") for r in ranges[1:]), ranges


def test_the_staging_service_lives_on_the_head_node(local_cluster):
    """The node that lasts as long as the cluster: on a worker node, the service (and every staging in flight) would
    go with that node. In CI it once landed on a test's extra node, which the test then removed."""
    where = get_service().__ray_call__.remote(lambda service: ray.get_runtime_context().get_node_id())
    head = [n["NodeID"] for n in ray.nodes() if n["Alive"] and "node:__internal_head__" in n["Resources"]]
    assert ray.get(where) in head


def _wait_gone(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    raise AssertionError(f"the staging task's worker (pid {pid}) outlived its owner by {timeout}s")


def _catch(into: list, fn) -> None:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - handed to the test thread
        into.append(e)


# ------------------------------------------------------------------------ the local rehearsal job


@pytest.mark.slow
def test_local_job_stages_the_standins_then_caches(local_cluster, tmp_path, standins):
    """`a4ray stage -f jobs/qwen3_next_local.yaml` (the rehearsal profile of the qwen3_next recipe: its stage
    step only) as a Ray job on the cluster: the tiny Qwen3-Next stand-ins."""
    seed_standins(tmp_path, standins)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [PYTHON, "-m", "a4ray.cli", "stage", "-f", str(REPO / "jobs" / "qwen3_next_local.yaml"),
           "--address", local_cluster.address]
    runs = [run_to_end([*cmd, "--result", f"r{i}.json"], cwd=tmp_path, env=env, timeout=300) for i in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[0].stdout + runs[0].stderr
    first, second = (json.loads((tmp_path / f"r{i}.json").read_text())["artifacts"] for i in range(2))
    assert {a["status"] for a in first} == {"ran"} and {a["status"] for a in second} == {"cached"}
    ws = tmp_path / ".a4ray"
    ckpt = ws / "ckpts" / "huggingface" / "Qwen3-Next-tiny"
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json", "merges.txt"} <= {
        p.name for p in ckpt.iterdir()}
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(ckpt).model_type == "qwen3_next"
    assert len(IndexedDataset(str(ws / "datasets" / "qwen-mmap" / "mmap_qwen3_datasets_text_document"))) == 256
    assert "OK: 3 artifact(s) (3 cached)" in runs[1].stdout


def test_a_local_source_that_changed_is_staged_again(local_cluster, tmp_path):
    """A file:// directory can change under its path (regenerated stand-ins): a cache hit is checked
    against the source's files (one stat each), and a changed source is restaged, not served stale."""
    source = tmp_path / "src"
    source.mkdir()
    (source / "weights.bin").write_bytes(b"v1" * 1000)
    spec = stage_job(tmp_path, {"name": "model", "source": f"file://{source}", "target": "model"})
    first = stage(spec, display=QUIET)
    again = stage(spec, display=QUIET)
    (source / "weights.bin").write_bytes(b"v2" * 1500)
    changed = stage(spec, display=QUIET)
    assert [r.artifacts[0].status for r in (first, again, changed)] == ["ran", "cached", "ran"]
    assert (published(changed, "model") / "weights.bin").read_bytes() == b"v2" * 1500


def test_the_shared_storage_check_leaves_out_a_node_that_left_after_it_was_listed(local_cluster, tmp_path, monkeypatch):
    """A node Ray still lists while it is going (a removed node is declared dead only after missed heartbeats) gets
    no probe scheduled: the check asks the nodes that are there, and records no verdict for a node set it could not
    check whole. Here the listed node that left is a node id no raylet has."""
    from a4ray.spec.artifacts import StagingOptions

    gone = {"NodeID": "ab" * 28, "Alive": True, "Resources": {"CPU": 1.0}, "Labels": {}}
    listed = stager.storage_nodes(StagingOptions())
    monkeypatch.setattr(stager, "storage_nodes", lambda options: [gone, *listed])
    workspace = tmp_path / "ws"
    (workspace / ".a4ray").mkdir(parents=True)
    stager.check_shared(workspace, StagingOptions(), job_nodes=2)  # the session's nodes share this machine's disk
    assert not list((workspace / ".a4ray").glob("shared-probe-*"))  # the probe file was removed
    ids = sorted(n["NodeID"] for n in [gone, *listed])
    assert ray.get(get_service().shared_ok.remote(str(workspace), ids)) is False
