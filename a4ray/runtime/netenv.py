"""The launch environment of a node: image env < gIB env < a4ray < workload < user overrides.

gIB's `set_nccl_env.sh` is the source of truth for A4 NCCL settings and changes between gIB releases,
so it is sourced on the node at launch (never hard-coded), and what it exports is taken over. The A4
overrides and `LD_LIBRARY_PATH` (gIB's lib64 first) follow. One rule beats every layer: a variable the
operator set in the node's environment to keep NVLink multicast off is never overridden.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field

from a4ray.core.errors import GibMissing
from a4ray.core.redact import Redactor, secret_values
from a4ray.spec.cluster import NetworkSpec

# Set by operators of shared multi-GPU hosts: NVLink multicast can take a shared host's GPUs down.
NEVER_OVERRIDE = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")

# The launch contract is a4ray's to set per node; stale values from the image or from Ray's own
# worker environment must not leak into torchrun, Pai or DeepEP.
LAUNCH_CONTRACT = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "NNODES",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
)

# Variables bash sets for itself; they say nothing about what a script exported.
_SHELL_NOISE = {"_", "SHLVL", "PWD", "OLDPWD"}


@dataclass
class EnvLayer:
    """Variables one source contributes. A value of None unsets the variable."""

    name: str
    vars: Mapping[str, str | None]


@dataclass
class LaunchEnv:
    env: dict[str, str]
    changes: dict[str, tuple[str | None, str]] = field(default_factory=dict)  # name -> (value, layer)
    notes: list[str] = field(default_factory=list)

    def report(self, redactor: Redactor | None = None) -> list[str]:
        """One line per variable a4ray set or unset, secrets masked, plus the notes."""
        redactor = redactor or Redactor(secret_values(self.env))
        shown = redactor.env({k: v for k, (v, _) in self.changes.items() if v is not None})
        lines = [
            f"{name}={shown[name]}  [{layer}]" if value is not None else f"unset {name}  [{layer}]"
            for name, (value, layer) in sorted(self.changes.items())
        ]
        return lines + [f"note: {n}" for n in self.notes]


_REPORTED = re.compile(r"^(?:unset )?(?P<name>[^=\s]+)(?:=(?P<value>.*))?  \[(?P<layer>[^\]]+)\]$")
_NODE_NAMED = re.compile(r"\bnode \d+ \([^)]*\)")


def summarize_reports(reports: list[list[str]], members: list[int], logs: str) -> list[str]:
    """The launch's env in a few lines for the job's stream, from every node's `report()` (the whole of
    which is in each node's log): the layers a4ray sets per node (a4ray's own, gIB's) by name, the
    workload's and the user's with their values (`=<per node>` where nodes differ), each note once with
    the nodes it is about."""
    by_layer: dict[str, dict[str, set[str | None]]] = {}
    notes: dict[str, list[int]] = {}
    for node, report in zip(members, reports):
        for line in report:
            if line.startswith("note: "):
                notes.setdefault(_NODE_NAMED.sub("each node", line[6:]), []).append(node)
            elif m := _REPORTED.match(line):
                by_layer.setdefault(m["layer"], {}).setdefault(m["name"], set()).add(m["value"])
    parts = []
    for layer, names in by_layer.items():
        if layer == "a4ray" or layer.startswith("gib"):
            parts.append(f"{layer}: {', '.join(sorted(names))}")
        else:
            shown = [f"unset {name}" if values == {None} else f"{name}={next(iter(values))}" if len(values) == 1
                     else f"{name}=<per node>" for name, values in sorted(names.items())]
            parts.append(f"{layer}: {' '.join(shown)}")
    nodes = f"nodes {members[0]}-{members[-1]}" if members == list(range(members[0], members[-1] + 1)) \
        else f"nodes {members}"
    lines = [f"env on {nodes} (every value, by layer: each node's log, {logs}/node-NN.log): "
             + ("; ".join(parts) or "nothing set by a4ray")]
    for note, on in notes.items():
        which = "" if len(on) == len(members) else f" (node{'s' if len(on) > 1 else ''} {', '.join(map(str, on))})"
        lines.append(f"  note{which}: {note}")
    return lines


def _env_of(command: str, base: Mapping[str, str], *args: str, timeout: float = 30) -> dict[str, str]:
    out = subprocess.run(
        ["bash", "-c", command, "a4ray-env", *args],
        env=dict(base), capture_output=True, timeout=timeout, check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"exit code {out.returncode}: {out.stderr.decode(errors='replace')[-500:]}")
    pairs = (item.partition("=") for item in out.stdout.decode(errors="replace").split("\0") if item)
    return {k: v for k, _, v in pairs}


def source_script(script: str, base: Mapping[str, str]) -> dict[str, str | None]:
    """What sourcing `script` in bash changes: new or changed variables, and removed ones as None."""
    before = _env_of("env -0", base)
    # The script's own output is discarded: it may print, and we only want its exports.
    after = _env_of('source "$1" >/dev/null 2>&1 || exit 97; env -0', base, script)
    changed: dict[str, str | None] = {k: v for k, v in after.items() if before.get(k) != v}
    changed.update({k: None for k in before if k not in after})
    return {k: v for k, v in changed.items() if k not in _SHELL_NOISE}


def _prepend_path(first: str, path: str | None) -> str:
    rest = [p for p in (path or "").split(":") if p and p != first]
    return ":".join([first, *rest])


def gib_layer(network: NetworkSpec, base: Mapping[str, str], node: str) -> tuple[EnvLayer | None, str]:
    """The gIB layer for one node, and a sentence saying what was done. Raises GibMissing if `on`."""
    if network.gib == "off":
        return None, "gIB off (network.gib=off)"
    script = network.gib_script
    problem = None
    if not os.path.isfile(script):
        problem = f"{script} not found"
    else:
        try:
            sourced = source_script(script, base)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            problem = f"sourcing {script} failed ({e})"
    if problem:
        if network.gib == "on":
            raise GibMissing(
                f"node {node}: network.gib=on but {problem}",
                hint="mount the gIB plugin at its root (KubeRay: the gIB init container or hostPath "
                "/home/kubernetes/bin/gib), fix network.gib_script, or set network.gib=auto",
            )
        return None, f"gIB not used on {node}: {problem} (network.gib=auto)"
    vars_: dict[str, str | None] = dict(sourced)
    vars_.update(network.gib_overrides)
    ld = vars_.get("LD_LIBRARY_PATH", base.get("LD_LIBRARY_PATH"))
    vars_["LD_LIBRARY_PATH"] = _prepend_path(network.gib_lib_dir, ld)
    return EnvLayer("gib", vars_), f"gIB: sourced {script} ({len(sourced)} variables) and applied A4 overrides"


def build_env(base: Mapping[str, str], layers: list[EnvLayer | None]) -> LaunchEnv:
    """Apply layers in order (later wins) over `base`, except the never-override variables."""
    env = {k: v for k, v in base.items() if k not in LAUNCH_CONTRACT}
    result = LaunchEnv(env=env)
    for name in LAUNCH_CONTRACT:
        if name in base:
            result.changes[name] = (None, "a4ray")
    for layer in layers:
        if layer is None:
            continue
        for name, value in layer.vars.items():
            if name in NEVER_OVERRIDE and name in base:
                if value != base[name]:
                    result.notes.append(
                        f"kept {name}={base[name]} set on the node; ignored {layer.name}'s "
                        f"{'unset' if value is None else repr(value)}"
                    )
                continue
            if value is None:
                env.pop(name, None)
            else:
                env[name] = value
            result.changes[name] = (value, layer.name)
    # A layer may set a variable back to what the node had: that is no change.
    result.changes = {k: c for k, c in result.changes.items() if base.get(k) != c[0]}
    return result


def describe_env_plan(net: NetworkSpec, workload_env: dict[str, str], defaults: dict[str, str] | None = None
                      ) -> list[str]:
    """The env a launch would get, layer by layer, for a dry run (nothing is sourced); `defaults`: what a4ray's
    layer sets where the node does not (the compile caches)."""
    lines = []
    if net.gib == "off":
        lines.append("gib: off")
    else:
        lines.append(f"gib ({net.gib}): source {net.gib_script} on each node"
                     + (" (fail if missing)" if net.gib == "on" else " (skip where missing)"))
        lines += [f"  {k}={v}" for k, v in net.gib_overrides.items()]
        lines.append(f"  LD_LIBRARY_PATH={net.gib_lib_dir}:<node's LD_LIBRARY_PATH>")
    lines.append("a4ray: PYTHONUNBUFFERED=1 A4RAY_NODE_RANK=<rank> A4RAY_ATTEMPT=<n> A4RAY_LAUNCH_ID=<id>"
                 + "".join(f" {k}={v}" for k, v in (defaults or {}).items()))
    for layer, env in (("workload", workload_env), ("user (network.env)", net.env)):
        shown = Redactor(secret_values(env)).env(env)
        lines.append(f"{layer}: " + (" ".join(f"{k}={v}" for k, v in shown.items()) or "-"))
    lines.append(f"never overridden where the node sets them: {', '.join(NEVER_OVERRIDE)}")
    return lines
