"""Every command of the README and the getting-started pages runs here, or is held to what runs it elsewhere.

Sybil parses the fenced code blocks of README.md and docs/getting-started/*.md (`DOCS`); each block is one test,
evaluated in the order of its page. A `console` block holds commands (`$ ` lines; a line ending in a backslash goes
on) and, under a command, output the page shows of it. Each command meets the first rule of `RULES` that matches it;
a command no rule matches fails, and so does a code block in a language no parser takes
(`test_every_code_block_is_accounted_for`): nothing is skipped without a word. The rules, by what they do:

- **run as typed**: `a4ray ...` and `python -m a4ray.<job>` that start no Ray cluster (`--help`, `--dry-run`,
  `render`), from a copy of the repository's root (its entries linked, plus the files the pages' `yaml` blocks write),
  through the function the command line calls. Output a page shows under such a command must appear in what it
  prints, in order (`...` elides).
- **dry run**: `a4ray up|submit|status|logs|down` need a GKE cluster; they run with `--dry-run` added, which loads
  the spec, renders and validates the manifests against the bundled KubeRay CRDs and prints the API calls.
- **the suite's own runs, not made twice**: `make rehearsal` is tests/test_pipeline.py's `rehearsal` fixture;
  `a4ray local up` is conftest's `local_up` (behind `shared_local_up` and tests/test_local_up.py); the local
  `ray job submit` line is the one `a4ray local up` prints, which tests/test_local_up.py asserts and submits;
  `a4ray local status` and `a4ray local down` are test_local_up.py's last test. The page's command must be the one
  those run, read from their source. `make test` is the suite itself (`.ci/run`).
- **Ray's CLI** (`ray job submit`, `ray get-auth-token`) is parsed by Ray's own click commands, options and all.
- **GKE prerequisites** (`gcloud`, `kubectl`, `helm`, `export`): they cannot run here (no cluster, no network), so
  each is checked against what a4ray renders or reads for the page's spec (`my-a4.yaml`): the nodes' accelerator
  label, the CRD names and KubeRay version a4ray validates against (a4ray/k8s/crds/README.md), the HF token Secret's
  name and key, the Ray token's Secret and key and the head pod's labels as a4ray/k8s/client.py reads them (called on
  a recording fake), the dashboard port, and KubeRay's name for the head's service, `<cluster>-head-svc`
  (GenerateHeadServiceName in ray-operator/controllers/ray/utils/util.go at v1.7.0, which a4ray does not override:
  it renders no `headService`). `gcloud builds submit` must be docker/README.md's command.
- **placeholders**: `git clone REPOSITORY_URL` and `cd`: nothing here to run them on.

A `yaml` block whose first line is `# <file>: ...` is a file the page has you write: it must load as an a4ray job
spec and, for a cluster, render with no warning. A `mermaid` block is the architecture picture the site draws
(docs/snippets/architecture.md), the same text.
"""

from __future__ import annotations

import ast
import base64
import contextlib
import importlib
import io
import os
import re
import shlex
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from conftest import REPO
from sybil import Sybil
from sybil.parsers.markdown import CodeBlockParser
from sybil.parsers.markdown.lexers import RawFencedCodeBlockLexer

README = REPO / "README.md"
GETTING_STARTED = REPO / "docs" / "getting-started"
ARCHITECTURE = REPO / "docs" / "snippets" / "architecture.md"
DOCS = [README, *sorted(GETTING_STARTED.glob("*.md"))]
README_LIMIT = 8000  # characters: what a newcomer reads first stays short; the rest is one link away in docs/
VENV_BIN = Path(sys.executable).parent
LANGUAGES = {"console": "commands", "yaml": "files the page has you write", "mermaid": "pictures"}
A4RAY_KUBE = {"up", "submit", "status", "logs", "down"}  # need a GKE cluster: run with --dry-run
NO_CLUSTER_FLAGS = {"--help", "-h", "--dry-run"}


# ------------------------------------------------------------------------------------------ the pages' commands


@dataclass
class Command:
    """One `$ ` command of a console block, and the output the page shows under it."""

    line: str
    where: str
    shown: list[str] = field(default_factory=list)

    @property
    def words(self) -> list[str]:
        """The command's words, without leading `VAR=value` assignments."""
        words = shlex.split(self.line, comments=True)
        while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
            words = words[1:]
        return words

    @property
    def assignments(self) -> dict[str, str]:
        env = {}
        for word in shlex.split(self.line, comments=True):
            name, eq, value = word.partition("=")
            if not (eq and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name)):
                break
            env[name] = value
        return env


def console_commands(source: str, where: str) -> list[Command]:
    commands: list[Command] = []
    pending = ""
    for number, raw in enumerate(source.splitlines()):
        if pending:
            pending += " " + raw.strip()
        elif raw.startswith("$ "):
            pending = raw[2:].strip()
        elif raw.strip():
            assert commands, f"{where}: output {raw!r} comes before any `$ ` command"
            commands[-1].shown.append(raw)
            continue
        else:
            continue
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        commands.append(Command(pending, f"{where}+{number}"))
        pending = ""
    assert not pending, f"{where}: a command ends in a backslash with nothing after it"
    return commands


@dataclass
class Checkout:
    """Where the commands run: the repository's entries linked, plus the files the pages' yaml blocks write."""

    root: Path
    files: dict[str, str]

    def cluster_spec(self):
        """The RayCluster spec the pages have you write (else the shipped one): what the kubectl lines refer to."""
        from a4ray.spec import load_job

        for name, text in self.files.items():
            if (yaml.safe_load(text) or {}).get("kind") == "cluster":
                return load_job(str(self.root / name), [])
        return load_job(str(REPO / "jobs" / "cluster-a4.yaml"), [])

    def rendered(self, **caps) -> dict:
        from a4ray.k8s.render import OperatorCaps, render_cluster

        return render_cluster(self.cluster_spec(), caps=OperatorCaps(**caps)).main


def run(command: Command, checkout: Checkout, argv: list[str] | None = None) -> str:
    """The command, which must exit 0, run in this process through the function its command line calls (`a4ray` is
    `a4ray.cli:main`, `python -m a4ray.<job>` the module's `main`): the same code, without a second of interpreter
    start and imports each. What it printed, stdout and stderr together, as a terminal shows them."""
    argv = argv or command.words
    code, out = _in_process(argv, checkout.root)
    assert code == 0, f"{command.where}: `{shlex.join(argv)}` exited {code}:\n{out}"
    return out


def _in_process(argv: list[str], cwd: Path) -> tuple[int, str]:
    if argv[0] == "a4ray":
        assert tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]["a4ray"] == "a4ray.cli:main"
        entry, args = importlib.import_module("a4ray.cli").main, argv[1:]
    else:
        assert argv[:2] == ["python", "-m"], argv
        entry, args = importlib.import_module(argv[2]).main, argv[3:]
    buffer, here, address = io.StringIO(), os.getcwd(), os.environ.pop("RAY_ADDRESS", None)
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            try:
                code = entry(args)
            except SystemExit as exit_:  # argparse's --help and errors
                code = 0 if exit_.code is None else exit_.code if isinstance(exit_.code, int) else 1
    finally:
        os.chdir(here)
        if address is not None:
            os.environ["RAY_ADDRESS"] = address
    return code, buffer.getvalue()


def assert_shows(command: Command, out: str) -> None:
    """Each line the page shows under the command is in its output, in order; `...` elides."""
    lines, at = out.splitlines(), 0
    for shown in command.shown:
        want = shown.strip().removesuffix("...").strip()
        if not want:
            continue
        found = next((i for i in range(at, len(lines)) if want in lines[i]), None)
        assert found is not None, f"{command.where}: the page shows {shown.strip()!r}, which `{command.line}` " \
                                  f"does not print (after line {at} of its output):\n{out[-4000:]}"
        at = found + 1


def shows_nothing(command: Command) -> None:
    assert not command.shown, (f"{command.where}: the page shows output of `{command.line}`, which this test does not "
                               "run as typed; describe it in prose, or run it")


# --------------------------------------------------------------------------------------------- the rules


def run_as_typed(command: Command, checkout: Checkout) -> None:
    assert_shows(command, run(command, checkout))


def dry_run(command: Command, checkout: Checkout) -> None:
    """`a4ray up|submit|status|logs|down`: --dry-run added (before a job's `--`), the command otherwise as typed."""
    words = command.words
    if "--dry-run" in words:
        assert_shows(command, run(command, checkout))
        return
    shows_nothing(command)
    cut = words.index("--") if "--" in words else len(words)
    run(command, checkout, [*words[:cut], "--dry-run", *words[cut:]])


def _function_lists(path: Path, function: str) -> list[list[str]]:
    """The list literals in `function` of `path`, names as their names and strings as themselves."""
    tree = ast.parse(path.read_text())
    body = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function)
    lists = []
    for node in ast.walk(body):
        if isinstance(node, ast.List):
            lists.append([e.value if isinstance(e, ast.Constant) else e.id if isinstance(e, ast.Name)
                          else f"*{ast.unparse(e.value)}" if isinstance(e, ast.Starred) else ast.unparse(e)
                          for e in node.elts])
    return lists


def _make_recipe(target: str) -> list[str]:
    """The recipe lines of a Makefile target."""
    lines = (REPO / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"{re.escape(target)}:", line))
    recipe = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip())
    return recipe


def same_as_the_rehearsal_fixture(command: Command, checkout: Checkout) -> None:
    """`make rehearsal` runs `$(PY) -m a4ray.qwen3_next`, which tests/test_pipeline.py's `rehearsal` fixture runs
    (with only a restart, a save check and a result file added)."""
    shows_nothing(command)
    assert _make_recipe("rehearsal") == ["$(PY) -m a4ray.qwen3_next"], _make_recipe("rehearsal")
    assert re.search(r"^rehearsal: install$", (REPO / "Makefile").read_text(), re.M)
    (cmd,) = [c for c in _function_lists(REPO / "tests" / "test_pipeline.py", "rehearsal") if c[:2] == ["PYTHON", "-m"]]
    assert cmd[2] == "a4ray.qwen3_next", cmd
    extra = cmd[3:]
    assert [extra[i] for i in range(0, len(extra), 2)] == ["--set"] * (len(extra) // 2 - 1) + ["--result"], extra


def same_as_the_local_up_fixture(command: Command, checkout: Checkout) -> None:
    """conftest's `local_up` runs `a4ray local up` with the page's options, on ports of its own."""
    from a4ray.cli import build_parser

    shows_nothing(command)
    words = command.words
    build_parser(words[1:]).parse_args(words[1:])  # a4ray's own parser takes it
    assert tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]["a4ray"] == "a4ray.cli:main"
    (cmd,) = [c for c in _function_lists(REPO / "tests" / "conftest.py", "local_up") if c[:3] == ["PYTHON", "-m",
                                                                                                 "a4ray.cli"]]
    assert cmd[3:3 + len(words) - 1] == words[1:], (cmd, words)
    assert [a for a in cmd[3 + len(words) - 1:] if a.startswith("-")] == ["--dashboard-port", "--client-port"], cmd


def same_as_local_status_then_down(command: Command, checkout: Checkout) -> None:
    """tests/test_local_up.py's last test runs `a4ray local status`, then `a4ray local down`, against its running
    `a4ray local up`, as a person does from another terminal (`local down` also sweeps /tmp of gone launches' pipe
    directories, which is no thing to do twice while other tests run)."""
    from a4ray.cli import build_parser

    shows_nothing(command)
    words = command.words
    assert words in (["a4ray", "local", "status"], ["a4ray", "local", "down"]), words
    build_parser(words[1:]).parse_args(words[1:])
    lists = _function_lists(REPO / "tests" / "test_local_up.py", "test_local_status_then_local_down_stops_it")
    assert ["PYTHON", "-m", "a4ray.cli", "local"] in lists and ["*cli", words[2]] in lists, lists


def ray_cli(words: list[str]) -> tuple[str, dict]:
    """Parse `ray ...` with Ray's own click commands (options checked; nothing runs): the command's name, params."""
    import click
    from ray.scripts.scripts import cli

    assert words[0] == "ray", words
    cmd, args, name, ctx = cli, words[1:], "ray", None
    while True:
        ctx = cmd.make_context(name, list(args), parent=ctx)
        if not isinstance(cmd, click.Group):
            return ctx.command_path, ctx.params
        name, cmd, args = cmd.resolve_command(ctx, [*ctx._protected_args, *ctx.args])


def same_as_local_up_prints(command: Command, checkout: Checkout) -> None:
    """The line `a4ray local up` prints on its default dashboard port, which tests/test_local_up.py asserts it prints
    and submits with."""
    from a4ray.cli import build_parser
    from a4ray.commands.local import HEADLINE
    from a4ray.runtime import auth

    shows_nothing(command)
    port = build_parser(["local", "up"]).parse_args(["local", "up"]).dashboard_port
    saved = os.environ.pop(auth.TOKEN_PATH_ENV, None)
    try:
        printed = auth.submit_hint(f"http://127.0.0.1:{port}") + HEADLINE
    finally:
        if saved is not None:
            os.environ[auth.TOKEN_PATH_ENV] = saved
    assert command.line == printed, (command.line, printed)
    assert "ray job submit --working-dir . --" in (REPO / "tests" / "test_local_up.py").read_text()
    path, params = ray_cli(command.words)
    assert path == "ray job submit" and params["working_dir"] == "." and params["entrypoint"], params


def the_recipe_on_a4(command: Command, checkout: Checkout) -> None:
    """`ray job submit -- python -m a4ray.<recipe>` on A4: what `a4ray submit` submits, less `--config` (the recipe's
    defaults are the shipped jobs/<recipe>.yaml: tests/test_recipes.py)."""
    from a4ray.k8s.render import default_entrypoint
    from a4ray.spec import load_job

    shows_nothing(command)
    path, params = ray_cli(command.words)
    assert path == "ray job submit" and params["working_dir"] is None, params
    entrypoint = list(params["entrypoint"])
    kind = entrypoint[2].removeprefix("a4ray.")
    assert entrypoint == default_entrypoint(load_job(None, [], kind=kind), None, []), entrypoint
    assert (REPO / "jobs" / f"{kind}.yaml").is_file()


def names_ray_get_auth_token(command: Command, checkout: Checkout) -> None:
    """Ray's command that prints this user's token; `a4ray local up` tells the user to run it. Not run: it prints a
    secret, and there is no local cluster here to be the token's."""
    shows_nothing(command)
    assert ray_cli(command.words) == ("ray get-auth-token", {"generate": False})
    assert "`ray get-auth-token`" in (REPO / "a4ray" / "commands" / "local.py").read_text()


class RecordingCore:
    """The CoreV1Api calls a4ray/k8s/client.py makes, recorded, with a token Secret and a head pod to answer."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []

    def read_namespaced_secret(self, **kwargs):
        self.calls.append(("read_namespaced_secret", kwargs))
        return {"data": {"auth_token": base64.b64encode(b"not-a-token").decode()}}

    def list_namespaced_pod(self, **kwargs):
        self.calls.append(("list_namespaced_pod", kwargs))
        return {"items": []}


def _token_secret(checkout: Checkout) -> tuple[str, str, str]:
    """(namespace, Secret, key) a4ray reads the Ray token from, for the page's cluster on KubeRay 1.7.0."""
    from a4ray.k8s.client import Kube
    from a4ray.k8s.render import AUTH_TOKEN_KEY

    core = RecordingCore()
    Kube(custom=None, core=core).auth_token(checkout.rendered())
    ((_, read),) = core.calls
    return read["namespace"], read["name"], AUTH_TOKEN_KEY


def _check_secret_read(text: str, checkout: Checkout, where: str) -> None:
    match = re.search(r"kubectl get secret (\S+) -o jsonpath='\{\.data\.(\w+)\}' \| base64 -d", text)
    assert match, f"{where}: not `kubectl get secret NAME -o jsonpath='{{.data.KEY}}' | base64 -d`: {text}"
    namespace, secret, key = _token_secret(checkout)
    assert (match[1], match[2], namespace) == (secret, key, "default"), (match.groups(), secret, key, namespace)


def token_secret(command: Command, checkout: Checkout) -> None:
    """The Ray token: the Secret and key a4ray's own clients read it from (in kubectl's default namespace, the
    spec's)."""
    shows_nothing(command)
    _check_secret_read(command.line, checkout, command.where)


def exports(command: Command, checkout: Checkout) -> None:
    """The variables Ray's CLI reads: the dashboard through the port-forward, token auth, and the token, by the names
    a4ray gives its own Ray containers where KubeRay has no authOptions."""
    from a4ray.k8s.render import DASHBOARD_PORT

    shows_nothing(command)
    env = {e["name"]: e for e in checkout.rendered(auth_options=False)["spec"]["headGroupSpec"]["template"]["spec"]
           ["containers"][0]["env"]}
    assignments = dict(re.findall(r"(\w+)=(\$\(.*\)|\S+)", command.line.removeprefix("export ")))
    assert assignments, command.line
    for name, value in assignments.items():
        if name == "RAY_ADDRESS":
            assert value == f"http://127.0.0.1:{DASHBOARD_PORT}", value
        elif name == "RAY_AUTH_MODE":
            assert value == env["RAY_AUTH_MODE"]["value"] == "token"
        elif name == "RAY_AUTH_TOKEN":
            assert "valueFrom" in env["RAY_AUTH_TOKEN"]
            _check_secret_read(value, checkout, command.where)
        else:
            pytest.fail(f"{command.where}: export of {name}, which no check knows")


def port_forward(command: Command, checkout: Checkout) -> None:
    """The head's dashboard: KubeRay's head service of the cluster, on the port a4ray's clients forward to."""
    from a4ray.k8s.render import DASHBOARD_PORT

    shows_nothing(command)
    words = command.words
    assert words[:2] == ["kubectl", "port-forward"] and len(words) == 4, words
    cluster = checkout.rendered()
    head = cluster["spec"]["headGroupSpec"]
    assert "headService" not in head and head["serviceType"] == "ClusterIP", head.get("serviceType")
    assert words[2] == f"svc/{cluster['metadata']['name']}-head-svc", words[2]
    assert cluster["metadata"]["namespace"] == "default"
    ports = {p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert words[3] == f"{DASHBOARD_PORT}:{DASHBOARD_PORT}" and ports["dashboard"] == DASHBOARD_PORT, (words, ports)


def node_label(command: Command, checkout: Checkout) -> None:
    """The A4 nodes: the accelerator label the rendered worker pods select."""
    shows_nothing(command)
    words = command.words
    assert words[:3] == ["kubectl", "get", "nodes"] and words[3] == "-l", words
    key, _, value = words[4].partition("=")
    selector = checkout.rendered()["spec"]["workerGroupSpecs"][0]["template"]["spec"]["nodeSelector"]
    assert selector[key] == value, (selector, words[4])


def kuberay_crds(command: Command, checkout: Checkout) -> None:
    """KubeRay's CRDs: the ones `a4ray up` reads (and validates manifests against)."""
    from a4ray.k8s.validate import GROUP, PLURALS

    shows_nothing(command)
    assert command.words[3:] == [f"{PLURALS[kind]}.{GROUP}" for kind in ("RayCluster", "RayJob")], command.words


def _bundled_kuberay() -> str:
    (tag,) = re.findall(r"at tag \*\*v([0-9.]+)\*\*", (REPO / "a4ray" / "k8s" / "crds" / "README.md").read_text())
    return tag


def helm_kuberay(command: Command, checkout: Checkout) -> None:
    """KubeRay's chart at the version whose CRDs a4ray bundles (the chart's own CRD files: tests/fixtures/kuberay)."""
    shows_nothing(command)
    words = command.words
    if words[:3] == ["helm", "repo", "add"]:  # KubeRay's published chart repository; the alias the install uses
        assert words[3:] == ["kuberay", "https://ray-project.github.io/kuberay-helm/"], words
        return
    assert words[:4] == ["helm", "install", "kuberay-operator", "kuberay/kuberay-operator"], words
    assert words[4:] == ["--version", _bundled_kuberay()], (words, _bundled_kuberay())
    assert "helm-chart/kuberay-operator/crds" in (REPO / "tests" / "fixtures" / "kuberay" / "SOURCE.md").read_text()


def hf_token_secret(command: Command, checkout: Checkout) -> None:
    """The Hub token's Secret, by the name and key the rendered pods take HF_TOKEN from; the value a placeholder."""
    shows_nothing(command)
    words = command.words
    secret, (literal,) = words[4], [w for w in words if w.startswith("--from-literal=")]
    key, _, value = literal.removeprefix("--from-literal=").partition("=")
    env = {e["name"]: e for e in checkout.rendered()["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
           ["env"]}
    ref = env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert (secret, key) == (ref["name"], ref["key"]) and value == "$HF_TOKEN", (words, ref)


def head_pod_exec(command: Command, checkout: Checkout) -> None:
    """A look at the run directories through the head pod: found by the labels a4ray's client finds it by; the
    directory is the recipe's workspace, which the page's storage mounts."""
    from a4ray.k8s.client import Kube
    from a4ray.spec import load_job

    shows_nothing(command)
    match = re.fullmatch(r"kubectl exec \$\(kubectl get pod -l (\S+) -o name\) -- ls (\S+)", command.line)
    assert match, command.line
    core = RecordingCore()
    cluster = checkout.rendered()
    Kube(custom=None, core=core).head_pod(cluster["metadata"]["name"], cluster["metadata"]["namespace"])
    ((_, listed),) = core.calls
    assert match[1] == listed["label_selector"], (match[1], listed)
    workspace = load_job(None, [], kind="qwen3_next").storage.workspace
    assert match[2] == f"{workspace}/runs", match[2]
    assert workspace in [v.mount_path for v in checkout.cluster_spec().kuberay.storage]


def gcloud(command: Command, checkout: Checkout) -> None:
    """`get-credentials`: what a4ray's own error says to run when no cluster is configured. `builds submit`:
    docker/README.md's command, whose docker/cloudbuild.yml exists."""
    shows_nothing(command)
    if command.words[:4] == ["gcloud", "container", "clusters", "get-credentials"]:
        assert command.line == "gcloud container clusters get-credentials CLUSTER --location LOCATION"
        assert "gcloud container clusters get-credentials CLUSTER --location" in \
            (REPO / "a4ray" / "k8s" / "client.py").read_text()
        return
    assert command.words[:3] == ["gcloud", "builds", "submit"], command.words
    docker = (REPO / "docker" / "README.md").read_text().replace("\\\n", " ")
    (documented,) = [" ".join(line.split()) for line in docker.splitlines() if line.startswith("gcloud builds submit")]
    assert command.line == documented, (command.line, documented)
    assert (REPO / command.words[command.words.index("--config") + 1]).is_file()


def make_target(command: Command, checkout: Checkout) -> None:
    """`make install` makes the venv the rehearsal runs in; `make test` is this suite itself, as `.ci/run` runs it."""
    shows_nothing(command)
    target = command.words[1]
    if target == "install":
        assert _make_recipe("install") == [] and re.search(r"^install: \$\(VENV\)/\.installed$",
                                                            (REPO / "Makefile").read_text(), re.M)
    else:
        assert target == "test" and [line for line in (REPO / ".ci" / "run").read_text().splitlines()
                                     if line and not line.startswith("#")][-1] == "make test"
        assert any("-m pytest" in line for line in _make_recipe("test")), _make_recipe("test")


def activate(command: Command, checkout: Checkout) -> None:
    """The venv every make target installs into."""
    shows_nothing(command)
    assert command.line == "source .venv/bin/activate"
    assert re.search(r"^VENV \?= \.venv$", (REPO / "Makefile").read_text(), re.M)
    assert (REPO / ".venv" / "bin" / "activate").is_file() or VENV_BIN.parent.name != ".venv"


def placeholder(command: Command, checkout: Checkout) -> None:
    """`git clone REPOSITORY_URL a4ray` and `cd a4ray`: the URL is the reader's; nothing here to clone."""
    shows_nothing(command)
    assert command.line in ("git clone REPOSITORY_URL a4ray", "cd a4ray"), command.line


def would_start_a_cluster(command: Command, checkout: Checkout) -> None:
    pytest.fail(f"{command.where}: `{command.line}` starts a Ray cluster: give it a rule that holds it to the run the "
                "suite already makes of it, or add --dry-run")


def _a4ray(words: list[str]) -> bool:
    return words[:1] == ["a4ray"] or words[:2] == ["python", "-m"] and words[2].startswith("a4ray.")


def _starts_no_cluster(words: list[str]) -> bool:
    return bool(NO_CLUSTER_FLAGS & set(words)) or words[:2] == ["a4ray", "render"] or words == ["a4ray"]


Rule = tuple[str, Callable[[Command], bool], Callable[[Command, Checkout], None]]
RULES: list[Rule] = [
    ("the rehearsal fixture", lambda c: c.line == "make rehearsal", same_as_the_rehearsal_fixture),
    ("make targets", lambda c: c.words[:1] == ["make"], make_target),
    ("the local_up fixture", lambda c: c.words[:3] == ["a4ray", "local", "up"], same_as_the_local_up_fixture),
    ("local status, local down", lambda c: c.words[:2] == ["a4ray", "local"], same_as_local_status_then_down),
    ("what local up prints", lambda c: c.words[:3] == ["ray", "job", "submit"] and "RAY_ADDRESS" in c.assignments,
     same_as_local_up_prints),
    ("a recipe on A4", lambda c: c.words[:3] == ["ray", "job", "submit"], the_recipe_on_a4),
    ("ray get-auth-token", lambda c: c.words[:2] == ["ray", "get-auth-token"], names_ray_get_auth_token),
    ("dry run on GKE", lambda c: c.words[:1] == ["a4ray"] and c.words[1:2] and c.words[1] in A4RAY_KUBE, dry_run),
    ("run as typed", lambda c: _a4ray(c.words) and _starts_no_cluster(c.words), run_as_typed),
    ("would start a cluster", lambda c: _a4ray(c.words), would_start_a_cluster),
    ("export", lambda c: c.words[:1] == ["export"], exports),
    ("the Ray token's Secret", lambda c: c.line.startswith("kubectl get secret "), token_secret),
    ("port-forward", lambda c: c.words[:2] == ["kubectl", "port-forward"], port_forward),
    ("A4 nodes", lambda c: c.words[:3] == ["kubectl", "get", "nodes"], node_label),
    ("KubeRay CRDs", lambda c: c.words[:3] == ["kubectl", "get", "crd"], kuberay_crds),
    ("the HF token Secret", lambda c: c.words[:4] == ["kubectl", "create", "secret", "generic"], hf_token_secret),
    ("the head pod", lambda c: c.words[:2] == ["kubectl", "exec"], head_pod_exec),
    ("helm", lambda c: c.words[:1] == ["helm"], helm_kuberay),
    ("gcloud", lambda c: c.words[:1] == ["gcloud"], gcloud),
    ("venv", lambda c: c.words[:1] == ["source"], activate),
    ("placeholders", lambda c: c.words[:2] in (["git", "clone"], ["cd", "a4ray"]), placeholder),
]


def rule_for(command: Command) -> Rule:
    for rule in RULES:
        if rule[1](command):
            return rule
    pytest.fail(f"{command.where}: no rule of tests/test_docs_commands.py takes `{command.line}`: run it there, or "
                "check it against what runs it")


# ------------------------------------------------------------------------------------------------ Sybil


def where(example) -> str:
    return f"{Path(example.path).relative_to(REPO)}:{example.line}"


def evaluate_console(example) -> None:
    for command in console_commands(example.parsed, where(example)):
        rule_for(command)[2](command, example.namespace["checkout"])


def written_file(example) -> tuple[str, str]:
    """(file name, text) of a yaml block, named by its first line: `# <file>: ...`."""
    match = re.match(r"# ([\w.-]+\.ya?ml):", example.parsed)
    assert match, f"{where(example)}: a yaml block's first line must name the file it is: `# my-file.yaml: ...`"
    return match[1], example.parsed


def evaluate_yaml(example) -> None:
    """The file loads as a job spec and, for a cluster, renders with no warning (its storage holds the workspace)."""
    from a4ray.k8s.render import render_cluster
    from a4ray.spec import load_job

    name, _ = written_file(example)
    spec = load_job(str(example.namespace["checkout"].root / name), [])
    if spec.kind == "cluster":
        assert render_cluster(spec).warnings == [], render_cluster(spec).warnings


def picture(example) -> None:
    """A diagram: nothing to run. It is the docs' architecture picture (docs/snippets/architecture.md, which the site's
    pages include), to the character: one picture, drawn once."""
    (drawn,) = [str(e.parsed) for e in SYBIL.parse(ARCHITECTURE)]
    assert str(example.parsed) == drawn, f"{where(example)}: not the picture of {ARCHITECTURE.relative_to(REPO)}"


SYBIL = Sybil(parsers=[CodeBlockParser("console", evaluate_console), CodeBlockParser("yaml", evaluate_yaml),
                       CodeBlockParser("mermaid", picture)], path=str(REPO))
DOCUMENTS = {path: SYBIL.parse(path) for path in DOCS}
EXAMPLES = [example for document in DOCUMENTS.values() for example in document]


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Checkout:
    root = tmp_path_factory.mktemp("docs-checkout")
    for entry in REPO.iterdir():
        if entry.name not in (".git", ".a4ray"):
            (root / entry.name).symlink_to(entry)
    files: dict[str, str] = {}
    for example in EXAMPLES:
        if example.region.evaluator is evaluate_yaml:
            name, text = written_file(example)
            assert files.setdefault(name, text) == text, f"{where(example)}: {name} is written twice, differently"
            (root / name).write_text(text)
    return Checkout(root, files)


@pytest.mark.parametrize("example", EXAMPLES, ids=where)
def test_code_block(example, checkout):
    example.namespace["checkout"] = checkout
    example.evaluate()


# ------------------------------------------------------------------------------------------- the pages as a whole


def test_the_getting_started_pages_are_there():
    assert {p.name for p in DOCS} >= {"README.md", "local.md", "a4.md"}, DOCS


def test_the_readme_is_short():
    text = README.read_text()
    assert len(text) <= README_LIMIT, f"README.md has {len(text)} characters; at most {README_LIMIT}: move the rest " \
                                      "into docs/"


def test_every_code_block_is_accounted_for():
    """Every fenced block is in a language a parser above takes, and no indented block hides a command."""
    lexer = RawFencedCodeBlockLexer(info_pattern=re.compile(r"(?P<info>[^\n]*)$\n", re.MULTILINE))
    for path, document in DOCUMENTS.items():
        fenced = list(lexer(document))
        for region in fenced:
            line = document.text.count("\n", 0, region.start) + 1
            assert region.lexemes["info"].strip() in LANGUAGES, \
                f"{path.relative_to(REPO)}:{line}: a ```{region.lexemes['info'].strip()} block, which no parser " \
                f"takes ({', '.join(f'{k}: {v}' for k, v in LANGUAGES.items())})"
        taken = {(e.region.start, e.region.end) for e in document}
        assert taken == {(r.start, r.end) for r in fenced}, f"{path}: a block Sybil did not take as one"
        outside = [line for line in _outside(document.text, fenced) if line.strip()]
        indented = [line for before, line in zip(["", *outside], outside)
                    if re.match(r"( {4}|\t)", line) and not re.match(r"\s*([-*]|\d+\.)\s|\s*\|", before) and
                    not re.match(r"( {2,}|\t)", before)]
        assert not indented, f"{path}: indented code, which no test reads: {indented}"


def _outside(text: str, regions) -> list[str]:
    kept, at = [], 0
    for region in sorted(regions, key=lambda r: r.start):
        kept.append(text[at:region.start])
        at = region.end
    kept.append(text[at:])
    return "".join(kept).splitlines()


def test_every_rule_is_used():
    """A rule no page needs any more is dead weight: remove it with the command."""
    used = {rule_for(c)[0] for e in EXAMPLES if e.region.evaluator is evaluate_console
            for c in console_commands(e.parsed, where(e))}
    assert used >= {name for name, _, _ in RULES} - {"would start a cluster"}, \
        {name for name, _, _ in RULES} - used


def test_the_readme_versions_are_the_pinned_ones():
    """Each version the README gives is in a file its table names."""
    section = README.read_text().split("## Versions", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:-1] for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert rows
    for component, version, pinned in rows:
        files = re.findall(r"`([^`]+)`", pinned)
        texts = [(REPO / f).read_text() for f in files]
        for value in re.findall(r"`([^`]+)`", version):
            assert any(value in text for text in texts), f"{component.strip()}: {value} is in none of {files}"


def test_the_image_a4_md_runs_is_one_cloud_build_pushes():
    a4 = (GETTING_STARTED / "a4.md").read_text()
    (registry,) = re.findall(r"_ARTIFACT_REGISTRY=(\S+)", a4)
    build = yaml.safe_load((REPO / "docker" / "cloudbuild.yml").read_text())
    pushed = {image.replace("${_ARTIFACT_REGISTRY}", registry).replace("${_TAG}", build["substitutions"]["_TAG"])
              for image in build["images"]}
    images = re.findall(r"^\s+image: (\S+)|kuberay\.image=(\S+)", a4, re.M)
    images = [a or b for a, b in images]
    assert images and set(images) <= pushed, (images, pushed)


def test_the_network_thresholds_a4_md_states_are_the_specs():
    from a4ray.spec import load_job

    a4 = (GETTING_STARTED / "a4.md").read_text()
    nccl = load_job(str(REPO / "jobs" / "nccl_test.yaml"), []).nccl
    for collective in nccl.collectives:
        assert f"`{collective}`" in a4, collective
    for collective, by_nodes in nccl.thresholds.items():
        ((nodes, gbps),) = by_nodes.items()
        assert f"at least {gbps:g} GB/s" in a4 and f"on {nodes} or more nodes" in a4 and f"`{collective}`" in a4


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub and MkDocs' toc make it (for the headings these pages have)."""
    return re.sub(r"\s+", "-", re.sub(r"[^\w\s-]", "", heading.strip().lower()))


def test_the_readmes_links_resolve():
    """README.md is no page of the site, so `mkdocs build --strict` checks none of its links: this does."""
    for target in re.findall(r"\]\(([^)\s]+)\)", README.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        assert (REPO / path).is_file(), f"README.md links {target}: no such file"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", (REPO / path).read_text(), re.M)
            assert anchor in {_slug(h) for h in headings}, f"README.md links {target}: no such heading"
