"""What a person sees of a4ray in Ray's dashboard, in Prometheus and in a notebook, against one `a4ray local up
--metrics`:

- runs as the README starts them: a network test through `a4ray.submit`, then the rehearsal from
  notebooks/qwen3_next_rehearsal.ipynb in a real Jupyter kernel joined to the cluster (the one run of the notebook,
  also submitted through `a4ray.submit`; test_api holds a DDP test's submission to its typed results);
- headless Chromium (Debian's `chromium`, driven over the DevTools protocol) gets in as the README says (the
  token from `ray get-auth-token`, pasted into the dashboard's Authentication Token field), and its Jobs page lists
  the notebook's run by name; its Actors page lists node actors named after run, step and node rank;
- the dashboard's own HTTP APIs (the ones those pages call) give each node actor's repr (node rank, host, IP,
  step, ranks), a node-rank suffix in the driver's topology order, a graceful end, and its ranks' lines in its log;
- the real Prometheus scrapes the cluster through Ray's service discovery, and every panel of a4ray's Grafana
  dashboard returns series through Prometheus' HTTP API;
- the Megatron trainer wrote its TensorBoard scalars where the run's output says.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import aiohttp
import pytest
from conftest import PYTHON, REPO, fresh_checkout, isolated_env, local_up, printed, run_notebook, seed_standins

import a4ray
from a4ray.driver.handle import job_metadata
from a4ray.observe.grafana import PANELS

pytestmark = pytest.mark.slow
RAY = str(Path(sys.executable).parent / "ray")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _defined_metrics() -> set[str]:
    """The a4ray metric names this checkout defines (a panel of a metric not yet defined is left out)."""
    names = set()
    for source in ("a4ray/observe/metrics.py", "a4ray/staging/display.py"):
        names |= set(re.findall(r'"(a4ray_[a-z0-9_]+)"', (REPO / source).read_text()))
    return names


def _get(url: str, token: str, timeout: float = 30) -> bytes:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return reply.read()


@pytest.fixture(scope="module")
def dash(tmp_path_factory, standins):
    if not (CHROMIUM and shutil.which("prometheus")):
        pytest.fail("needs Debian's chromium and prometheus: make system-deps")
    checkout = fresh_checkout(tmp_path_factory)
    env = isolated_env(checkout)
    started = time.time()
    with local_up(checkout, env, "--metrics", ray_client=False) as up:
        said = up.said
        gcs = re.search(r" at (\S+): \d+ simulated ", said).group(1)
        prometheus = re.search(r"Prometheus at (http://\S+)", said).group(1)
        address = up.address
        token = subprocess.run([RAY, "get-auth-token"], env=env, capture_output=True, text=True,
                               check=True).stdout.strip()
        # A run through the Python API from a process of its own, then the rehearsal as the README submits it.
        api = subprocess.run([PYTHON, "-c", (
            "import a4ray, sys; a4ray.connect(sys.argv[1]);"
            # the CPU rehearsal of the network test: its busbw for the Fabric bandwidth panel
            "spec = a4ray.load(None, 'cluster.gpus_per_node=1', 'nccl.cpu_max_bytes=1M', 'nccl.iters=1',"
            " 'nccl.warmup=1', 'nccl.collectives=[all_reduce]', kind='nccl_test');"
            "print('NCCL', a4ray.submit(spec).wait(300))"), gcs],
            cwd=checkout, env=env, capture_output=True, text=True, timeout=600)
        assert "NCCL SUCCEEDED" in api.stdout, api.stdout[-3000:] + api.stderr[-3000:]
        # The main job from a notebook (notebooks/qwen3_next_rehearsal.ipynb) on this cluster: its kernel connects
        # to it (RAY_ADDRESS), as a notebook started beside `a4ray local up` does, and submits the rehearsal as a
        # Ray job: staged, converted and verified, preflighted, trained.
        # Its workspace is the notebook's own (.a4ray beside it), where its stand-ins are.
        seed_standins(checkout / "notebooks", standins)
        cells = run_notebook("qwen3_next_rehearsal", checkout, {**env, "RAY_ADDRESS": gcs})
        run_id = re.search(r"^(\S+) (?:PENDING|RUNNING|SUCCEEDED) ", printed(cells), re.M).group(1)
        run = a4ray.get_run(run_id, workspace=checkout / "notebooks" / ".a4ray")
        time.sleep(6)  # one more scrape (every 5 s) of what the last ranks reported
        yield {"checkout": checkout, "env": env, "address": address, "gcs": gcs, "said": said, "token": token,
               "started": started,
               "prometheus": prometheus,
               "run": run, "stream": run.logs(), "notebook": cells}


def test_the_rehearsal_notebook_ran_its_run_on_the_cluster_it_joined(dash):
    """The notebook's own cells assert on what they show (a falling loss, goodput, the A4 plan and RayJob); its run is
    a Ray job of this cluster, recorded in the notebook's workspace (.a4ray beside it)."""
    shown = "".join(o.get("data", {}).get("text/plain", "") for o in dash["notebook"][0].outputs)
    assert shown.startswith("<a4ray.Cluster ") and dash["gcs"] in shown, shown  # connected to it, not one of its own
    run = dash["run"]
    assert run.status() == "SUCCEEDED" and run.root.parent == dash["checkout"] / "notebooks" / ".a4ray" / "runs"
    assert [s.status for s in run.result().steps] == ["ran", "ran", "ran", "ran"]


def _job_name(run) -> str:
    """What the Jobs page names a run submitted through `a4ray.submit` (its Ray job's `job_name`)."""
    return job_metadata(run.spec(), run.id)["job_name"]  # "qwen3-next-local (qwen3_next recipe)"


def _actors(dash) -> list[dict]:
    reply = json.loads(_get(f"{dash['address']}/api/v0/actors?detail=1&limit=1000", dash["token"]))
    return reply["data"]["result"]["result"]


# ----------------------------------------------------------------------------------------------- Chromium


class Browser:
    """Headless Chromium over the DevTools protocol (one page)."""

    def __init__(self, ws, session: aiohttp.ClientSession):
        self.ws, self.session, self._id = ws, session, 0

    async def call(self, method: str, **params):
        self._id += 1
        await self.ws.send_json({"id": self._id, "method": method, "params": params})
        while True:
            message = await self.ws.receive_json(timeout=60)
            if message.get("id") == self._id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    async def text(self) -> str:
        try:
            result = await self.call("Runtime.evaluate", expression="document.body ? document.body.innerText : ''",
                                     returnByValue=True)
        except RuntimeError as e:  # the page was navigating (the dashboard reloads itself after the login)
            if "navigated" in str(e):
                return ""
            raise
        return result["result"].get("value", "")

    async def wait_text(self, *wanted: str, timeout_s: float = 60) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            text = await self.text()
            if all(w in text for w in wanted) or time.monotonic() > deadline:
                return text
            await asyncio.sleep(0.5)


async def _browse(dash, shots: Path) -> dict[str, str]:
    """The README's way in, then the Jobs and Actors pages' text (and a screenshot of each)."""
    profile = tempfile.mkdtemp(prefix="a4ray-chromium-")
    chromium = subprocess.Popen([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                 "--remote-debugging-port=0", f"--user-data-dir={profile}", "--window-size=1600,1000",
                                 "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env={**os.environ, "TMPDIR": profile})  # its own temp files go with the profile
    pages: dict[str, str] = {}
    try:
        active = Path(profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (active.is_file() and active.read_text().strip()) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        port = active.read_text().split()[0]
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/json/list") as reply:
                target = next(t for t in await reply.json() if t["type"] == "page")
            async with session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                page = Browser(ws, session)
                await page.call("Page.enable")
                await page.call("Page.navigate", url=f"{dash['address']}/#/jobs")
                pages["login"] = await page.wait_text("Authentication Token Required")
                # Paste the token into the dialog's field and press its Submit button, as a person does.
                await page.call("Runtime.evaluate", expression="document.querySelector('[role=dialog] input').focus()")
                await page.call("Input.insertText", text=dash["token"])
                await page.call("Runtime.evaluate", expression=(
                    "[...document.querySelectorAll('[role=dialog] button')]"
                    ".find(b => b.innerText.trim().toUpperCase() === 'SUBMIT').click()"))
                deadline = time.monotonic() + 30
                while "Authentication Token Required" in await page.text() and time.monotonic() < deadline:
                    await asyncio.sleep(0.5)
                run = dash["run"]  # the notebook's
                for name, path, wanted in (("jobs", "#/jobs", (_job_name(run), run.id)),
                                           ("actors", "#/actors", (f"{run.id}-train-n0",))):
                    await page.call("Page.navigate", url=f"{dash['address']}/{path}")
                    pages[name] = await page.wait_text(*wanted)
                    shot = await page.call("Page.captureScreenshot", format="png")
                    (shots / f"{name}.png").write_bytes(base64.b64decode(shot["data"]))
    finally:
        chromium.terminate()
        chromium.wait(timeout=30)
        deadline = time.monotonic() + 30  # its helper processes may still write there for a moment
        while Path(profile).exists() and time.monotonic() < deadline:
            shutil.rmtree(profile, ignore_errors=True)
            time.sleep(0.5)
    return pages


def test_a_browser_gets_in_with_the_token_and_finds_the_runs_and_node_actors(dash, tmp_path):
    # `a4ray local up` says how to get in; it never prints the token itself.
    assert "ray get-auth-token" in dash["said"] and "Authentication Token" in dash["said"]
    assert dash["token"] and dash["token"] not in dash["said"]
    pages = asyncio.run(_browse(dash, tmp_path))
    assert "Authentication Token Required" in pages["login"]
    run = dash["run"]
    assert _job_name(run) in pages["jobs"] and run.id in pages["jobs"], pages["jobs"][:3000]
    for step in ("preflight", "train"):
        for rank in (0, 1):
            assert f"{run.id}-{step}-n{rank}" in pages["actors"], pages["actors"][:3000]
    # The screenshots stay in tmp_path where this test fails (pytest keeps a failed test's directory), to look at;
    # A4RAY_DOCS_SCREENSHOTS=DIR keeps them for the docs too (docs/img/dashboard-jobs.png: see docs/figures.py).
    docs = os.environ.get("A4RAY_DOCS_SCREENSHOTS")
    if docs:
        for page in ("jobs", "actors"):
            shutil.copyfile(tmp_path / f"{page}.png", Path(docs) / f"dashboard-{page}.png")


# ------------------------------------------------------------------------------------- the dashboard's APIs


def test_node_actors_carry_run_step_rank_and_host_in_topology_order(dash):
    run = dash["run"]  # the notebook's
    assert run.status() == "SUCCEEDED" and run.root.name.startswith("qwen3-next-local-")
    actors = {a["name"]: a for a in _actors(dash) if a["name"].startswith(run.id)}
    # The driver's topology order: "  node <rank>: <host> (<ip>, <location>) gpus=... actor <name>".
    order = re.findall(r"node (\d): \S+ \((127\.0\.\d+\.\d+), [^)]*\) gpus=\S+ actor (\S+)", dash["stream"])
    assert {name for _, _, name in order} == set(actors), (order, sorted(actors))
    assert {f"{run.id}-{step}-n{r}" for step in ("preflight", "train") for r in (0, 1)} == set(actors)
    nodes = json.loads(_get(f"{dash['address']}/api/v0/nodes?detail=1&limit=100", dash["token"]))
    ip_of = {n["node_id"]: n["node_ip"] for n in nodes["data"]["result"]["result"]}
    # The Cluster page names each simulated node by its host label, not the machine's one hostname.
    assert {n["node_name"] for n in nodes["data"]["result"]["result"]} == {"head", "sim-host-000", "sim-host-001"}
    for rank, ip, name in order:
        actor = actors[name]  # the suffix is the driver's node rank, and the actor runs on that node
        assert name.endswith(f"-n{rank}") and ip_of[actor["node_id"]] == ip, (name, ip, ip_of[actor["node_id"]])
        step = name.split("-")[-2]
        host = f"sim-host-{int(ip.rsplit('.', 1)[1]) - 2:03d}"
        assert actor["repr_name"] == (f"NodeActor(node {rank} {host} {ip} block sim-block-0; run {run.id} step "
                                      f"{step} ranks {rank})"), actor["repr_name"]
        # A finished gang's actors ended themselves: Ray says so, not "killed by ray.kill".
        assert actor["state"] == "DEAD"
        died = json.dumps(actor.get("death_cause") or {})
        assert "INTENDED_USER_EXIT" in died and "ray.kill" not in died, died
    # The staging service stays up between jobs on purpose, and says what it is.
    staging = [a for a in _actors(dash) if a["name"].startswith("a4ray-staging-")]
    assert staging and all("staging service" in a["repr_name"] for a in staging), staging


def test_a_node_actors_log_has_its_ranks_lines_and_the_stream_has_them_once(dash):
    run = dash["run"]
    actor = next(a for a in _actors(dash) if a["name"] == f"{run.id}-train-n1")
    log = _get(f"{dash['address']}/api/v0/logs/file?actor_id={actor['actor_id']}&lines=100000",
               dash["token"]).decode(errors="replace")
    last = run.spec().train.iterations
    iteration = re.compile(rf"^\[n1 r1\] .*iteration\s+{last}/\s*{last} \|", re.M)
    assert iteration.search(log), log[-3000:]
    assert "[n0 " not in log  # node 1's actor: node 1's ranks only
    # The driver streams each line at most once: no second copy forwarded from the actors' stdout.
    assert len(iteration.findall(dash["stream"])) <= 1
    assert "(NodeActor" not in dash["stream"]


# ---------------------------------------------------------------------------------------------- Prometheus


def test_every_grafana_panel_returns_series_from_the_real_prometheus(dash):
    """Each panel's PromQL, as a Grafana time series panel asks it (a range query over the runs' time): a node
    actor's series end when it does (Prometheus marks them stale), so an instant query after the run finds none."""
    defined = _defined_metrics()
    health = json.loads(_get(f"{dash['address']}/api/prometheus_health", dash["token"]))
    assert health.get("result") is True, health  # the dashboard found the Prometheus local up started
    checked = []
    for panel in PANELS:
        if not set(panel.metrics) <= defined:
            continue  # a metric another branch adds: checked here once it is defined
        series = _query_range(dash, panel.expr)
        assert series, (panel.title, panel.expr)
        checked.append(panel.title)
    assert {"Loss", "Tokens per second", "Staging throughput", "Conversion throughput", "Fabric bandwidth"} <= set(checked)
    run = dash["run"]
    assert run.id in {s["metric"].get("run") for s in _query_range(dash, "ray_a4ray_train_loss")}


def _query_range(dash, expr: str) -> list[dict]:
    now = time.time()
    query = urllib.parse.urlencode({"query": expr, "start": dash["started"], "end": now, "step": 5})
    with urllib.request.urlopen(f"{dash['prometheus']}/api/v1/query_range?{query}", timeout=30) as reply:
        answer = json.loads(reply.read())
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def test_the_megatron_trainer_writes_tensorboard_scalars_where_it_says(dash):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    said = re.search(r"tensorboard --logdir (\S+)", dash["stream"])
    assert said, dash["stream"][-3000:]
    events = EventAccumulator(said.group(1))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"lm loss", "learning-rate", "grad-norm", "iteration-time", "tokens-per-sec",
            "node-step-time/node-0", "node-step-time/node-1"} <= tags, tags
    assert [e.step for e in events.Scalars("lm loss")] == list(range(1, dash["run"].spec().train.iterations + 1))
