"""Parse one a4ray command line with ms-swift's own argument dataclasses; run by a `.venv-swift/<version>` python.

    python parse_argv.py '{"command": "swift export", "argv": [...], "post_init": true}'

prints one JSON line: {"ok": bool, "unknown": [flags ms-swift does not define], "error": "..."}. This file is
a4ray's test harness, not ms-swift code: it imports the installed ms-swift's classes and calls its parsers.

- post_init true: ms-swift's own `swift.utils.parse_args` (transformers' HfArgumentParser over the dataclass), as
  `swift export` runs it, so the dataclass's `__post_init__` runs too (model info from the checkpoint's
  config.json, the output directory check, a gloo process group: no GPU needed).
- post_init false: the same HfArgumentParser, `parse_known_args` only: every flag must exist and its value must
  convert to the field's type and choices, without instantiating the dataclass. For the Megatron classes: their
  `__post_init__` needs Megatron-LM's `megatron.training` (3.x: a git checkout, no package), and `swift.megatron`'s
  package init clones and patches it; so the argument modules are loaded without that init, and 3.x's
  `swift.megatron.model` (which imports `megatron.training` and is needed only by `__post_init__`) is replaced by
  a module whose one function says so when called.
"""

from __future__ import annotations

import importlib
import json
import sys
import traceback
import types
from pathlib import Path

import swift

SWIFT_DIR = Path(swift.__file__).parent
VERSION = tuple(int(p) for p in swift.__version__.split(".")[:2])

# (command, major version) -> (module, class): where each version defines the arguments of a command.
CLASSES = {
    ("swift export", 3): ("swift.llm.argument.export_args", "ExportArguments"),
    ("swift export", 4): ("swift.arguments.export_args", "ExportArguments"),
    ("megatron export", 3): ("swift.megatron.argument.export_args", "MegatronExportArguments"),
    ("megatron export", 4): ("swift.megatron.arguments.export_args", "MegatronExportArguments"),
    ("megatron rlhf", 3): ("swift.megatron.argument.rlhf_args", "MegatronRLHFArguments"),
    ("megatron rlhf", 4): ("swift.megatron.arguments.rlhf_args", "MegatronRLHFArguments"),
}


def _without_megatron_init() -> None:
    """Load `swift.megatron`'s submodules without its package init (see the module docstring)."""
    package = types.ModuleType("swift.megatron")
    package.__path__ = [str(SWIFT_DIR / "megatron")]
    sys.modules["swift.megatron"] = package
    if VERSION[0] == 3:
        model = types.ModuleType("swift.megatron.model")

        def get_megatron_model_meta(*_args, **_kwargs):
            raise RuntimeError("__post_init__ of ms-swift 3.x Megatron arguments needs Megatron-LM (megatron.training)")

        model.get_megatron_model_meta = get_megatron_model_meta
        sys.modules["swift.megatron.model"] = model


def argument_class(command: str):
    module, name = CLASSES[(command, VERSION[0])]
    if command.startswith("megatron") and VERSION[0] == 3:
        _without_megatron_init()
    return getattr(importlib.import_module(module), name)


def main(request: dict) -> dict:
    from transformers import HfArgumentParser

    cls = argument_class(request["command"])
    argv = request["argv"]
    parser = HfArgumentParser([cls])
    try:
        _, unknown = parser.parse_known_args(argv)
    except SystemExit:  # argparse printed which flag and value it refused
        return {"ok": False, "unknown": [], "error": "argparse refused a value (stderr says which)"}
    unknown = [a for a in unknown if a.startswith("--")]
    if unknown or not request.get("post_init"):
        return {"ok": not unknown, "unknown": unknown, "error": ""}
    from swift.utils import parse_args

    try:
        _, remaining = parse_args(cls, argv)
    except Exception as error:  # noqa: BLE001 - what ms-swift raises is the finding
        traceback.print_exc()
        return {"ok": False, "unknown": [], "error": f"{type(error).__name__}: {error}"}
    return {"ok": not remaining, "unknown": remaining, "error": ""}


if __name__ == "__main__":
    print("A4RAY_PARSE " + json.dumps(main(json.loads(sys.argv[1]))), flush=True)
