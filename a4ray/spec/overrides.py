"""Specs as text: YAML (1.2 booleans), Helm-style `--set a.b.c=value` overrides, and validation whose
errors name the file, the dotted field, what was expected and what was given, and which `--set`
supplied the value, e.g.::

    invalid spec jobs/ddp_test.yaml:
      - cluster.nodes: expected a valid integer, got 'two' (from --set cluster.nodes=two)
      - ddp_test.stepz: unknown field; did you mean 'steps'? (allowed: backend, batch_size, ...)
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from a4ray.core.errors import SpecError
from a4ray.core.redact import MASK, is_secret_name, secret_in_spec

Override = tuple[str, Any, str]  # (dotted path, parsed value, how the user wrote it)
# A `--set` as typed, or (the assignment an option stands for, the option as typed: `--local-nodes 0`), so that an
# error names what the user gave.
Given = str | tuple[str, str]
Token = str | int
J = TypeVar("J", bound=BaseModel)


class _Yaml12Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 booleans (only true/false: `gib: on` must stay the string "on"), made strict:
    a key given twice in one mapping (PyYAML keeps the last, silently) and aliases (`*name`: a few lines of
    them expand to billions of values) are errors, at the line where they are."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, typing.Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark,
                    f"key {key!r} is given twice (first at line {seen[key] + 1}): a spec says each field once",
                    key_node.start_mark)
            if isinstance(key, typing.Hashable):
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, f"the alias *{event.anchor} is not allowed in a4ray specs: write the value out",
                event.start_mark)
        return super().compose_node(parent, index)


_Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool",
    __import__("re").compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
    list("tTfF"),
)


def parse_yaml(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=_Yaml12Loader)
    except RecursionError:
        raise SpecError(source, ["not valid YAML: nested too deeply (brackets or indentation thousands of levels "
                                 "deep)"], hint="a spec's fields nest a few levels") from None
    except yaml.YAMLError as e:
        mark, context = getattr(e, "problem_mark", None), getattr(e, "context_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = str(getattr(e, "problem", None) or e)
        if context is not None and getattr(e, "context", None) and (mark is None or context.line != mark.line):
            problem += f", {e.context} that starts at line {context.line + 1}, column {context.column + 1}"
        raise SpecError(source, [f"not valid YAML{where}: {problem}"],
                        hint="check the indentation (spaces, not tabs), quotes and brackets there") from None


def read_yaml_file(path: Path, source: str) -> Any:
    """A spec file's YAML; a missing file, a directory or bytes that are not text are errors naming it."""
    if path.is_dir():
        raise SpecError(source, ["is a directory, not a spec file"], hint="pass the YAML file in it, e.g. "
                        f"{source.rstrip('/')}/ddp_test.yaml")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(source, ["file not found"],
                        hint="pass --config with a path to a YAML spec, e.g. jobs/ddp_test.yaml") from None
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise SpecError(source, [f"not UTF-8 text (byte 0x{e.object[e.start]:02x} on line {line})"],
                        hint="save the spec as UTF-8 YAML") from None
    except OSError as e:
        raise SpecError(source, [f"cannot be read: {e.strerror}"]) from None
    return parse_yaml(text, source)


class _NoAliasDumper(yaml.SafeDumper):
    """Writes a value seen twice out twice: what a4ray writes, its strict loader reads back."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump_yaml(data: Any) -> str:
    return yaml.dump(data, Dumper=_NoAliasDumper, sort_keys=False, default_flow_style=False)


# --------------------------------------------------------------------------------------- --set


def _split_top_level(text: str, sep: str) -> list[str]:
    """Split on `sep` outside brackets and quotes; `\\<sep>` escapes it (as in Helm)."""
    parts, buf, depth, quote, i = [], [], 0, "", 0
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text) and text[i + 1] == sep:
            buf.append(sep)
            i += 2
            continue
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append("".join(buf))
            buf = []
            i += 1
            continue
        buf.append(ch)
        i += 1
    parts.append("".join(buf))
    return parts


def parse_sets(items: Sequence[Given]) -> list[Override]:
    """`["a.b=1,c[0]=x"]` -> `[("a.b", 1, "--set a.b=1"), ("c[0]", "x", "--set c[0]=x")]` (values typed by YAML);
    `[("cluster.nodes=0", "--local-nodes 0")]` -> `[("cluster.nodes", 0, "--local-nodes 0")]`."""
    overrides: list[Override] = []
    for item in items:
        text, option = (item, None) if isinstance(item, str) else item
        for assignment in _split_top_level(text, ","):
            if not assignment.strip():
                continue
            key, eq, raw = assignment.partition("=")
            if not eq or not key.strip():
                raise SpecError(option or "--set", [f"{assignment!r}: expected key=value (e.g. cluster.nodes=4)"])
            # A value given for a secret-looking key (hf_token=...) is never echoed back in errors.
            shown = f"{key.strip()}={MASK}" if is_secret_name(key) else assignment.strip()
            origin = option or f"--set {shown}"
            value = parse_yaml(raw, origin) if raw.strip() else ""
            overrides.append((key.strip(), value, origin))
    return overrides


def parse_path(path: str) -> list[Token]:
    """`a.b[0].c` or `a.b.0.c` -> ["a", "b", 0, "c"]; `\\.` keeps a dot inside a key."""
    tokens: list[Token] = []
    for segment in _split_top_level(path.replace("[", ".[") if "[" in path else path, "."):
        if not segment:
            continue
        if segment.startswith("[") and segment.endswith("]") and segment[1:-1].isdigit():
            tokens.append(int(segment[1:-1]))
        elif segment.isdigit():
            tokens.append(int(segment))
        else:
            tokens.append(segment)
    if not tokens:
        raise SpecError("--set", [f"empty key in {path!r}"])
    return tokens


def _assign(root: dict, tokens: list[Token], value: Any, origin: str) -> None:
    node: Any = root
    for depth, token in enumerate(tokens):
        last = depth == len(tokens) - 1
        where = dotted(tokens[:depth]) or "the top level"
        if isinstance(node, list):
            if not isinstance(token, int):
                raise SpecError("--set", [f"{origin}: {where} is a list; index it with [N]"])
            if token > len(node):
                raise SpecError("--set", [f"{origin}: index {token} is past the end of {where} ({len(node)} items)"])
            if token == len(node):
                node.append(None)
        elif isinstance(node, dict):
            token = str(token)
        else:
            raise SpecError("--set", [f"{origin}: {where} is a {type(node).__name__}, not a mapping or list"])
        if last:
            node[token] = value
        else:
            nxt = tokens[depth + 1]
            if (node[token] if isinstance(node, list) else node.get(token)) is None:
                node[token] = [] if isinstance(nxt, int) else {}
            node = node[token]


def dotted(loc: tuple | list) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def apply_overrides(spec: J, overrides: list[Override]) -> J:
    """Validate `spec` with overrides applied to its full (defaults included) form."""
    if not overrides:
        return spec
    data = spec.model_dump(mode="json")
    origins = assign_all(data, overrides)
    return validate(type(spec), data, getattr(spec, "source", "<python>"), origins)


def assign_all(data: dict, overrides: list[Override]) -> dict[tuple, str]:
    origins: dict[tuple, str] = {}
    for path, value, origin in overrides:
        tokens = parse_path(path)
        _assign(data, tokens, value, origin)
        origins[tuple(tokens)] = origin
    return origins


# ---------------------------------------------------------------------------------- validation


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, typing.Annotated):
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found:
                return found
    return None


def _model_at(cls: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    for part in loc:
        field = cls.model_fields.get(part) if isinstance(part, str) else None
        sub = _model_in(field.annotation) if field else None
        if sub is None:
            return None
        cls = sub
    return cls


def _describe(error: dict, cls: type[BaseModel]) -> str:
    loc = tuple(error["loc"])
    kind = error["type"]
    if kind == "extra_forbidden":
        parent = _model_at(cls, loc[:-1])
        allowed = sorted(parent.model_fields) if parent else []
        close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        text = "unknown field" + (f"; did you mean '{close[0]}'?" if close else "")
        return text + (f" (allowed: {', '.join(allowed)})" if allowed else "")
    if kind == "missing":
        return "required field is missing"
    if kind == "secret_in_spec":
        return secret_in_spec(dotted(loc))
    msg = error["msg"].replace("Value error, ", "")
    if kind in ("int_type", "float_type"):  # spec.fields.Integer / Number: what a count is, not "a valid integer"
        msg = "Input should be " + ("an integer" if kind == "int_type" else "a number") + (
            " (true and false are not numbers)" if isinstance(error.get("input"), bool) else "")
    if msg.startswith("Input should be "):
        wanted = msg.removeprefix("Input should be ")
        article = "" if wanted.startswith(("a ", "an ", "'", '"', "one of", "a valid")) else "a value "
        msg = f"expected {article}{wanted}"
    given = error.get("input")
    if any(isinstance(part, str) and is_secret_name(part) for part in loc):
        return msg  # never echo what was given for a secret-looking field
    if kind != "model_type" and not isinstance(given, (dict, list)):
        shown = repr(given)
        msg += f", got {shown if len(shown) <= 60 else shown[:57] + '...'}"
    return msg


def validate(cls: type[J], data: Any, source: str, origins: dict[tuple, str] | None = None) -> J:
    if not isinstance(data, dict):
        raise SpecError(source, [f"the top level must be a mapping of fields, got {type(data).__name__}"])
    try:
        spec = cls.model_validate(data)
    except ValidationError as err:
        problems = []
        for error in err.errors(include_url=False):
            ctx = error.get("ctx") or {}  # a validator may name the field below its own: a key, or a path
            loc = tuple(error["loc"]) + ((ctx["key"],) if "key" in ctx else tuple(ctx.get("path", ())))
            error["loc"] = loc
            origin = next((o for path, o in (origins or {}).items() if loc[: len(path)] == path), None)
            line = f"{dotted(loc) or '(top level)'}: {_describe(error, cls)}"
            problems.append(line + (f" (from {origin})" if origin else ""))
        raise SpecError(source, problems) from None
    if hasattr(spec, "_source"):
        spec._source = source
    return spec
