"""A run directory under the workspace: the run's record. The resolved spec, the plan, per-node/per-rank
logs (each step of a pipeline in its own `logs/<step>/`), and `result.json`: the typed result, or how the
run ended without one (cancelled, refused). Everything is written through here, redacted.

It lives on shared storage, so it outlives the Ray cluster: `<workspace>/runs/<job>-<time>-<id>/`.
`driver.json` names the process that fills it; a reader that finds no result and that process gone (SIGKILLed,
evicted, its node lost) records so in `result.json` ("DRIVER LOST: ...").
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from pathlib import Path

from pydantic import BaseModel

from a4ray.core.errors import A4RayError
from a4ray.core.liveness import start_mark, still_running
from a4ray.core.redact import redact


def ray_submission_id() -> str | None:
    """The submission id (`raysubmit_...`, or the one given) of the Ray job this process drives, if a job API started
    it: Ray's job supervisor hands its driver the job's config, the id in its metadata, in this variable
    (ray/dashboard/modules/job/job_supervisor.py, `_get_driver_env_vars`)."""
    try:
        config = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}")
        return (config.get("metadata") or {}).get("job_submission_id") or None
    except (ValueError, AttributeError):
        return None


class RunDir:
    def __init__(self, root: Path):
        self.root = root

    @classmethod
    def create(cls, workspace: Path, job: str) -> RunDir:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        root = workspace / "runs" / f"{job}-{stamp}-{secrets.token_hex(2)}"
        (root / "logs").mkdir(parents=True, exist_ok=False)
        return cls(root)

    @classmethod
    def existing(cls, root: str | Path) -> RunDir:
        """A run directory made before the run starts (`a4ray.submit` makes it, the job's driver fills it)."""
        root = Path(root)
        if not (root / "logs").is_dir():
            raise A4RayError(f"{root} is not a run directory (no logs/ in it)",
                             hint="give --run-dir a directory made by a4ray.submit, or leave it out")
        return cls(root)

    @property
    def id(self) -> str:
        return self.root.name

    @property
    def workspace(self) -> Path:
        """The workspace the run is recorded in (`<workspace>/runs/<id>`)."""
        return self.root.parent.parent

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def step_logs(self, step: str) -> Path:
        """Where one step of a pipeline logs (per node and per rank)."""
        return self.logs / step

    def write_spec(self, spec: BaseModel) -> Path:
        return self.write("spec.yaml", spec.to_yaml())

    def write_plan(self, plan: str | BaseModel) -> Path:
        """The plan as run: `plan.json` (a launch's nodes, commands and env) or `plan.txt` (a pipeline's steps)."""
        return self.write("plan.txt", plan) if isinstance(plan, str) else self.write("plan.json", plan)

    def write_result(self, result: BaseModel) -> Path:
        return self.write("result.json", result)

    def write_driver(self) -> None:
        """Name this process as the run's driver (a reader then tells a run in progress from one whose driver died),
        and the Ray job it drives where `ray job submit` started it (`a4ray.get_run` finds the run by that id)."""
        self.write("driver.json", {"pid": os.getpid(), "host": socket.gethostname(),
                                   "started": start_mark(),
                                   "ray_submission_id": ray_submission_id()})

    def driver(self) -> dict:
        """What `write_driver` recorded ({} if nothing, or nothing readable)."""
        try:
            return json.loads((self.root / "driver.json").read_text())
        except (OSError, ValueError):
            return {}

    def driver_lost(self) -> str | None:
        """Why the run will never record a result, if its driver is gone: it recorded none, and its process
        (on this host) no longer exists. None while it may still be running, or where this cannot be told."""
        if (self.root / "result.json").exists():
            return None
        driver = self.driver()
        if not driver or driver.get("host") != socket.gethostname():
            return None
        if still_running(driver["pid"], driver["started"]):
            return None
        return (f"its driver (pid {driver['pid']} on {driver['host']}) is gone without recording a result: killed "
                "(SIGKILL, evicted, out of memory) or its node was lost; Ray stopped its node actors and their "
                "process trees")

    def write_outcome(self, kind: str, verdict: str) -> None:
        """How the run ended without a typed result (cancelled, refused), unless it recorded one."""
        if not (self.root / "result.json").exists():
            self.write("result.json", {"kind": kind, "ok": False, "verdict": verdict})

    def write(self, name: str, content: str | BaseModel | dict) -> Path:
        path = self.root / name
        if isinstance(content, BaseModel):
            content = content.model_dump_json(indent=2)
        elif isinstance(content, dict):
            content = json.dumps(content, indent=2, default=str)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(redact(content))
        tmp.replace(path)
        return path
