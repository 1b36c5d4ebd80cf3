"""Typed errors: each one carries what the user needs to act on it, and never a secret.

Every a4ray error is an `A4RayError`. Entry points print `str(error)` and exit non-zero; the text is
passed through the redactor first, so a token that slipped into a message is masked anyway.
"""

from __future__ import annotations

from a4ray.core.redact import redact


class A4RayError(Exception):
    """Base class. `hint` says what to do about it."""

    exit_code = 2

    def __init__(self, message: str, *, hint: str | None = None):
        self.message = message
        self.hint = hint
        super().__init__(message)

    def __str__(self) -> str:
        text = self.message if not self.hint else f"{self.message}\n  hint: {self.hint}"
        return redact(text)

    def __reduce__(self):
        # Subclasses take other constructor arguments than `args`; rebuild from the attributes so an
        # error raised in a Ray task reaches the driver as itself.
        return (_rebuild, (type(self), self.__dict__.copy()))


def _rebuild(cls: type[A4RayError], state: dict) -> A4RayError:
    error = cls.__new__(cls)
    Exception.__init__(error, state.get("message", ""))
    error.__dict__.update(state)
    return error


class SpecError(A4RayError):
    """A spec file or override does not validate. Names the file, the dotted field and the problem."""

    def __init__(self, source: str, problems: list[str], *, hint: str | None = None):
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid spec {source}:\n{lines}", hint=hint)


class ConnectError(A4RayError):
    """The Ray cluster named by --address / RAY_ADDRESS cannot be reached."""


class GangStartTimeout(A4RayError):
    """The placement group for the gang was not placed within cluster.start_timeout_s."""


class GangUnplaceable(GangStartTimeout):
    """No node set the cluster has can hold the gang, and nothing can add nodes: said at once, not after
    cluster.start_timeout_s."""


class GibMissing(A4RayError):
    """network.gib is `on` but a node lacks set_nccl_env.sh (or sourcing it failed)."""


class EnvScriptFailed(A4RayError):
    """An env script a launch asked for (e.g. DeepEP's unified-env.sh) is missing on a node or fails."""


class ToolMissing(A4RayError):
    """A tool the spec requires (nccl-tests binaries, mpirun) is missing on some nodes."""


class Failed(A4RayError):
    """The job ran and failed; `result` holds what it got to (printed and recorded with the error)."""

    exit_code = 1

    def __init__(self, message: str, *, result=None, hint: str | None = None):
        self.result = result
        super().__init__(message, hint=hint)


class GangFailed(Failed):
    """A node of the gang failed (non-zero exit, actor death, node loss); the gang was torn down."""


class GangTimeout(GangFailed):
    """The launch ran past its timeout; every node's process group was terminated."""


class GangHang(GangFailed):
    """The watchdog saw no progress; the stacks of every rank were dumped and the gang was stopped."""


class Cancelled(GangFailed):
    """The launch was cancelled (Ctrl-C, `ray job stop`); every node's process group was terminated."""

    exit_code = 130


class ManifestInvalid(A4RayError):
    """A rendered KubeRay manifest would be refused by the API server, the operator or Kueue."""


class KubeError(A4RayError):
    """The Kubernetes API refused or failed a call (no cluster, no KubeRay, object exists, forbidden, ...)."""


class StagingError(A4RayError):
    """An artifact could not be staged. Names the artifact; nothing half-done was published."""

    def __init__(self, artifact: str, message: str, *, hint: str | None = None):
        self.artifact = artifact
        super().__init__(f"artifact {artifact!r}: {message}" if artifact else message, hint=hint)


class StagingFailed(Failed):
    """One or more artifacts failed to stage; `result` holds every artifact's outcome."""


class StepError(A4RayError):
    """A pipeline step cannot run or did not finish: names the step, and what is missing or failed."""

    exit_code = 1

    def __init__(self, step: str, message: str, *, hint: str | None = None):
        self.step = step
        super().__init__(f"step {step}: {message}", hint=hint)


class ConvertError(A4RayError):
    """A checkpoint conversion could not run or did not produce a good checkpoint."""


class UnsupportedModel(ConvertError):
    """The input's architecture is not one the chosen conversion backend handles."""


class ConvertInputError(ConvertError):
    """The input checkpoint is incomplete or inconsistent (missing shards or tensors, wrong shapes)."""


class InsufficientResources(ConvertError):
    """Not enough disk at the output, or memory on a node, for the conversion as planned."""


class ConvertFailed(ConvertError):
    """A conversion task (or the gang of a pai/swift conversion) failed; nothing was committed."""

    exit_code = 1


class VerifyFailed(ConvertError):
    """The written checkpoint does not reproduce the input (logits or round trip beyond tolerance)."""

    exit_code = 1
