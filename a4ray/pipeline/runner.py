"""The pipeline: the job of every recipe kind. Its steps, in order, on the driver's connection, recorded
in the driver's one run directory.

    import a4ray

    result = a4ray.run(a4ray.load("jobs/qwen3_next.yaml", "train.mode=sft"))
    [(s.name, s.status) for s in result.steps]   # [("stage", "cached"), ("convert", "ran"), ...]

Each step reports ran | cached | skipped (or failed) and its duration. `pipeline.skip` / `pipeline.start`
(--skip, --from) skip steps; a skipped step's outputs must exist, and the missing ones are named. A rerun
after a failure redoes nothing that finished: staging and conversion are cached by what they produced,
the train step by a marker next to its output, and an interrupted training resumes from its newest
checkpoint. `<workspace>/runs/<job>-<time>-<id>/` holds the resolved spec, the plan, the logs (per step,
node and rank) and `result.json`, rewritten after every step.
"""

from __future__ import annotations

import time

from a4ray.core.console import say
from a4ray.core.errors import A4RayError, Cancelled, SpecError
from a4ray.core.rundir import RunDir
from a4ray.pipeline import nodefs
from a4ray.pipeline.pipeline_result import PipelineResult, StepResult, first_line
from a4ray.pipeline.steps import Context, Step, failed, steps_of
from a4ray.runtime.connect import Connection
from a4ray.spec.recipes import STEPS, RecipeJob
from a4ray.trainers import trainer_for


class Pipeline:
    """The job of a recipe: stage -> convert -> preflight -> train, each step ran | cached | skipped (or failed).
    A step that fails ends it with `ok=False` (later steps `not-run`); Ctrl-C / `ray job stop` records the
    run, then propagates."""

    cancel_note = "; run the same command again to resume (finished steps are cached)"

    def __init__(self, spec: RecipeJob):
        self.spec = spec

    def check(self) -> None:
        """Refuse, before anything runs, what a step would reject later (the train step's configuration)."""
        spec = self.spec
        if spec.pipeline.start in spec.pipeline.skip:
            raise SpecError(spec.source, [f"pipeline.start={spec.pipeline.start} is also in pipeline.skip"])
        if not spec.pipeline.skipped("train"):
            trainer_for(spec, spec.storage.workspace).check()

    def plan(self, workspace: str | None = None) -> str:
        """What running the pipeline would do, from the spec alone (nothing runs, no cluster): for --dry-run;
        with `workspace`, its paths as the nodes of a connected cluster see them."""
        spec = self.spec
        ws = workspace or spec.storage.workspace
        where = "" if workspace else f" (on an embedded local cluster: {spec.storage.local_workspace})"
        c = spec.cluster
        lines = [f"pipeline {spec.name!r} ({spec.kind}): {' -> '.join(STEPS)} on {c.nodes} node(s) x "
                 f"{c.gpus_per_node} GPU(s) ({c.machine_type}); workspace {ws}{where}"]
        for step in steps_of(spec, ws):
            reason = _skip_reason(spec, step) or step.not_needed()
            lines.append(f"\n[{step.name}] " + (f"skipped: {reason}" if reason else step.runs()))
            if spec.pipeline.skipped(step.name) and spec.pipeline.read_later(step.name) and not step.not_needed():
                lines += [f"  must exist: {what}: {path}" for what, path in step.outputs(ws).items()]
            elif not reason:
                lines += [f"  {line}" for line in step.plan(ws)]
        return "\n".join(lines)

    def run(self, conn: Connection, run_dir: RunDir) -> PipelineResult:
        spec = self.spec
        workspace = conn.workspace(spec.storage)  # the driver made the run directory in it
        ctx = Context(spec=spec, conn=conn, workspace=str(workspace), run_dir=run_dir)
        result = PipelineResult(kind=spec.kind, job=spec.name, ok=False, verdict="running", run_dir=str(run_dir.root),
                                workspace=str(workspace))
        steps = steps_of(spec, str(workspace), simulated=conn.simulated)
        t_start = time.monotonic()
        try:
            for index, step in enumerate(steps):
                outcome = _run_step(step, ctx)
                result.steps.append(outcome)
                run_dir.write_result(result)
                if outcome.status == "cancelled":
                    raise KeyboardInterrupt
                if outcome.status == "failed":
                    result.steps += _not_run(steps[index + 1:])
                    break
        except KeyboardInterrupt:
            done = {s.name for s in result.steps}
            result.steps += _not_run([s for s in steps if s.name not in done])
            result.cancelled = True
            result.verdict = "CANCELLED (Ctrl-C or `ray job stop`); run again to resume"
            run_dir.write_result(result)
            raise
        result.ok = all(s.status in ("ran", "cached", "skipped") for s in result.steps)
        result.verdict = _verdict(result, time.monotonic() - t_start)
        return result


def _skip_reason(spec: RecipeJob, step: Step) -> str | None:
    p = spec.pipeline
    if step.name in p.skip:
        return f"--skip {step.name}"
    if p.skipped(step.name):
        return f"--from {p.start}"
    return None


def _not_run(steps: list[Step]) -> list[StepResult]:
    return [StepResult(name=s.name, status="not-run", runs=s.runs()) for s in steps]


def _run_step(step: Step, ctx: Context) -> StepResult:
    spec, t0 = ctx.spec, time.monotonic()
    try:
        skip = _skip_reason(spec, step)
        not_needed = step.not_needed()
        if skip:
            detail = skip
            if not_needed:
                detail += f" (not needed anyway: {not_needed})"
            elif not spec.pipeline.read_later(step.name):
                detail += " (no step after it runs)"
            else:
                lost = nodefs.missing(spec.cluster, step.outputs(ctx.workspace))
                if lost:
                    raise A4RayError(f"step {step.name} is skipped ({skip}), but its outputs are missing: "
                                     + "; ".join(lost), hint=f"run the {step.name} step (drop {skip})")
                step.adopt(ctx)
                if step.outputs(ctx.workspace):
                    detail += f"; its outputs are there ({len(step.outputs(ctx.workspace))} checked)"
            say(f"step {step.name}: skipped: {detail}")
            return StepResult(name=step.name, status="skipped", seconds=time.monotonic() - t0, runs=step.runs(),
                              detail=detail)
        if not_needed:
            say(f"step {step.name}: skipped: {not_needed}")
            return StepResult(name=step.name, status="skipped", runs=step.runs(), detail=not_needed)
        say(f"step {step.name}: {step.runs()}")
        outcome = step.run(ctx)
    except (KeyboardInterrupt, Cancelled) as stop:
        # Recorded as the step that was running, with how far it got: a rerun resumes from there.
        say(f"step {step.name}: cancelled after {time.monotonic() - t0:.1f}s")
        return StepResult(name=step.name, status="cancelled", seconds=time.monotonic() - t0, runs=step.runs(),
                          detail=_how_far(stop))
    except Exception as error:  # noqa: BLE001 - a step's failure is recorded and ends the pipeline
        outcome = failed(step.name, error, time.monotonic() - t0, step.runs())
        say(f"step {step.name}: FAILED: {outcome.detail}")
        return outcome
    outcome.seconds, outcome.runs = time.monotonic() - t0, step.runs()
    say(f"step {step.name}: {outcome.status} in {outcome.seconds:.1f}s: {first_line(outcome.detail, 200)}")
    return outcome


def _how_far(stop: BaseException) -> str:
    """What a cancelled step had done: the iteration its launch reached, where it trains."""
    gang = getattr(stop, "result", None)
    last = getattr(gang, "last_iteration", None)
    if last is None:
        return "cancelled (Ctrl-C or `ray job stop`); a rerun runs it again (finished steps are cached)"
    saved = getattr(gang, "saved_on_notice", None)
    if saved is not None:
        return (f"cancelled (Ctrl-C or `ray job stop`) at iteration {last}; checkpoint iteration {saved} saved on "
                "notice: a rerun resumes from it")
    return (f"cancelled (Ctrl-C or `ray job stop`) at iteration {last}; a rerun resumes from the newest "
            "checkpoint saved")


def _verdict(result: PipelineResult, seconds: float) -> str:
    if result.ok:
        return "OK: " + ", ".join(f"{s.name} {s.status}" for s in result.steps) + f" in {seconds:.1f}s"
    bad = next(s for s in result.steps if s.status == "failed")
    return f"FAILED at {bad.name}: {first_line(bad.detail, 300)}"

