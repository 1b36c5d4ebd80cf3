"""Typed errors: each one carries what the user needs to act on it, and never a secret.

Every a4ray error is an `A4RayError`. Entry points print `str(error)` and exit non-zero; the text is
passed through the redactor first, so a token that slipped into a message is masked anyway.
"""

from __future__ import annotations


class A4RayError(Exception):
    """Base class. `hint` says what to do about it."""

    exit_code = 2

    def __init__(self, message: str, *, hint: str | None = None):
        self.message = message
        self.hint = hint
        super().__init__(message)

    def __str__(self) -> str:
        from a4ray.redact import redact

        text = self.message if not self.hint else f"{self.message}\n  hint: {self.hint}"
        return redact(text)


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


class GibMissing(A4RayError):
    """network.gib is `on` but a node lacks set_nccl_env.sh (or sourcing it failed)."""


class GangFailed(A4RayError):
    """A node of the gang failed (non-zero exit, actor death, node loss); the gang was torn down."""

    exit_code = 1

    def __init__(self, message: str, *, result=None, hint: str | None = None):
        self.result = result
        super().__init__(message, hint=hint)


class GangTimeout(GangFailed):
    """The launch ran past its timeout; every node's process group was terminated."""


class Cancelled(GangFailed):
    """The launch was cancelled (Ctrl-C, `ray job stop`); every node's process group was terminated."""

    exit_code = 130


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
