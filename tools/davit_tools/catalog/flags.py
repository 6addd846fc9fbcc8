"""Which command-line flags a release's `vllm serve` defines, read from its source.

Three ways a flag comes to exist, each recorded with where it was found:
- `add_argument`: a literal flag in an `add_argument(...)` call (`vllm/engine/arg_utils.py`, the
  serve argument modules under `vllm/entrypoints/`);
- `field`: an annotated field of a frontend-arguments class whose module adds one flag per field
  (an `add_argument` taking `f"--{key.replace('_', '-')}"`);
- `negation`: `--no-NAME` of a flag whose config field is typed `bool` (the release's kwargs
  builder gives booleans `argparse.BooleanOptionalAction`; the field's annotation is recorded).

This is the static reading; the parser check (`parser_check`) is the ground truth.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from davit_tools.catalog.pysource import unparse
from davit_tools.catalog.wheel import ReleaseWheel

ARG_UTILS = "vllm/engine/arg_utils.py"


@dataclass(frozen=True)
class FlagSource:
    """How a flag exists: `how` (add_argument, field or negation), the file and line, and a
    short note (the config field and its annotation for a negation)."""

    how: str
    source: str
    line: int
    note: str = ""


def _serve_argument_files(wheel: ReleaseWheel) -> list[str]:
    files = [ARG_UTILS] if wheel.has(ARG_UTILS) else []
    for path in wheel.python_files("vllm/entrypoints/"):
        if path.endswith("cli_args.py") or path.endswith("cli/serve.py"):
            files.append(path)
    return files


def _is_add_argument(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "add_argument"
    )


def _is_field_flag(node: ast.Call) -> bool:
    """An add_argument whose flag is built from a field name: f"--{key.replace('_', '-')}"."""
    return any(
        isinstance(arg, ast.JoinedStr)
        and len(arg.values) == 2
        and isinstance(arg.values[0], ast.Constant)
        and arg.values[0].value == "--"
        and isinstance(arg.values[1], ast.FormattedValue)
        for arg in node.args
    )


def _spread(node: ast.Call) -> str | None:
    """The kwargs a call spreads (`**model_kwargs["x"]`, also inside `**{**model_kwargs["x"],
    ...}`), as source text."""
    for keyword in node.keywords:
        if keyword.arg is not None:
            continue
        value = keyword.value
        if isinstance(value, ast.Dict):
            inner = [v for k, v in zip(value.keys, value.values, strict=True) if k is None]
            return unparse(inner[0]) if inner else None
        return unparse(value)
    return None


@dataclass(frozen=True)
class _Explicit:
    flag: str
    source: str
    line: int
    kwargs_from: str | None  # `model_kwargs['enable_prefix_caching']` when the call spreads one


def _explicit(wheel: ReleaseWheel, path: str) -> tuple[list[_Explicit], bool]:
    """Literal flags of `path`'s add_argument calls, and whether it adds one flag per field."""
    found: list[_Explicit] = []
    per_field = False
    for node in ast.walk(wheel.tree(path)):
        if not _is_add_argument(node):
            continue
        assert isinstance(node, ast.Call)
        if _is_field_flag(node):
            per_field = True
        spread = _spread(node)
        for arg in node.args:
            literal = arg.value if isinstance(arg, ast.Constant) else None
            if isinstance(literal, str) and literal.startswith("-"):
                found.append(_Explicit(literal, path, node.lineno, spread))
    return found, per_field


def _class_fields(wheel: ReleaseWheel, path: str) -> list[tuple[str, str, int, str]]:
    """(class, field, line, annotation) of every annotated class-level field in `path`."""
    fields: list[tuple[str, str, int, str]] = []
    for node in wheel.tree(path).body:
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    fields.append(
                        (node.name, item.target.id, item.lineno, unparse(item.annotation))
                    )
    return fields


def _kwargs_classes(wheel: ReleaseWheel) -> dict[str, str]:
    """`model_kwargs` -> `ModelConfig` for each `X = get_kwargs(Class)` in arg_utils."""
    out: dict[str, str] = {}
    for node in ast.walk(wheel.tree(ARG_UTILS)):
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name)
            and node.value.func.id == "get_kwargs"
            and node.value.args
            and isinstance(node.value.args[0], ast.Name)
        ):
            out[node.targets[0].id] = node.value.args[0].id
    return out


def _config_field(wheel: ReleaseWheel, class_name: str, field: str) -> tuple[str, int, str] | None:
    """(file, line, annotation) of `class_name.field` among vllm/config/*.py."""
    for path in wheel.python_files("vllm/config/"):
        for owner, name, line, annotation in _class_fields(wheel, path):
            if owner == class_name and name == field:
                return path, line, annotation
    return None


def _is_boolean(annotation: str) -> bool:
    """A field the kwargs builder turns into --X/--no-X: typed bool, not bool-or-str."""
    parts = {p.strip() for p in annotation.replace("Optional[", "").rstrip("]").split("|")}
    return "bool" in parts and "str" not in parts


def release_flags(wheel: ReleaseWheel) -> dict[str, FlagSource]:
    """Every flag the serve parser defines, as far as the source states it."""
    flags: dict[str, FlagSource] = {}
    kwargs_classes = _kwargs_classes(wheel) if wheel.has(ARG_UTILS) else {}
    for path in _serve_argument_files(wheel):
        explicit, per_field = _explicit(wheel, path)
        for entry in explicit:
            flags.setdefault(entry.flag, FlagSource("add_argument", entry.source, entry.line))
            if not entry.flag.startswith("--") or entry.kwargs_from is None:
                continue
            variable, _, key = entry.kwargs_from.partition("[")
            config_class = kwargs_classes.get(variable)
            field_name = key.strip("]'\"")
            located = _config_field(wheel, config_class, field_name) if config_class else None
            if located is not None and _is_boolean(located[2]):
                negation = "--no-" + entry.flag[2:]
                flags.setdefault(
                    negation,
                    FlagSource(
                        "negation",
                        located[0],
                        located[1],
                        f"{config_class}.{field_name}: {located[2]}",
                    ),
                )
        if per_field:
            for owner, name, line, annotation in _class_fields(wheel, path):
                flag = "--" + name.replace("_", "-")
                flags.setdefault(flag, FlagSource("field", path, line, f"{owner}.{name}"))
                if _is_boolean(annotation):
                    flags.setdefault(
                        "--no-" + flag[2:],
                        FlagSource("negation", path, line, f"{owner}.{name}: {annotation}"),
                    )
    return dict(sorted(flags.items()))


@dataclass(frozen=True)
class KeyCheck:
    """One key of a JSON-valued flag checked against the config class it is validated into:
    `path` (`pass_config.enable_sp`), the class, and where the field is defined (None: the
    class has no such field)."""

    path: str
    config_class: str
    source: str | None
    line: int | None


def _flag_config_class(wheel: ReleaseWheel, flag: str) -> str | None:
    """The config class a JSON-valued flag's field is typed with, e.g. `--compilation-config`
    -> `CompilationConfig` (from `vllm_kwargs["compilation_config"]` and the field annotation)."""
    kwargs_classes = _kwargs_classes(wheel)
    explicit, _ = _explicit(wheel, ARG_UTILS)
    for entry in explicit:
        if entry.flag != flag or entry.kwargs_from is None:
            continue
        variable, _, key = entry.kwargs_from.partition("[")
        owner = kwargs_classes.get(variable)
        located = _config_field(wheel, owner, key.strip("]'\"")) if owner else None
        if located is not None:
            return _named_config_class(wheel, located[2])
    return None


def _named_config_class(wheel: ReleaseWheel, annotation: str) -> str | None:
    """The first vllm/config class named in `annotation` (`SpeculativeConfig | None`)."""
    for word in annotation.replace("|", " ").replace("[", " ").replace("]", " ").split():
        if _config_class_file(wheel, word.strip("'\"")) is not None:
            return word.strip("'\"")
    return None


def _config_class_file(wheel: ReleaseWheel, class_name: str) -> str | None:
    for path in wheel.python_files("vllm/config/"):
        for node in wheel.tree(path).body:
            if isinstance(node, ast.ClassDef) and node.name == class_name:
                return path
    return None


def json_keys(wheel: ReleaseWheel, flag: str, value: object) -> list[KeyCheck]:
    """Each key of `value` (nested objects too) checked against the fields of the config class
    the release validates `flag`'s JSON into; empty when the flag has no config class."""
    config_class = _flag_config_class(wheel, flag)
    if config_class is None or not isinstance(value, dict):
        return []
    checks: list[KeyCheck] = []

    def walk(class_name: str, obj: dict[str, object], prefix: str) -> None:
        path = _config_class_file(wheel, class_name)
        fields = {
            name: (line, annotation)
            for owner, name, line, annotation in (_class_fields(wheel, path) if path else [])
            if owner == class_name
        }
        for key, item in sorted(obj.items()):
            found = fields.get(key)
            checks.append(
                KeyCheck(
                    f"{prefix}{key}",
                    class_name,
                    path if found else None,
                    found[0] if found else None,
                )
            )
            if found and isinstance(item, dict):
                inner = _named_config_class(wheel, found[1])
                if inner is not None:
                    walk(inner, item, f"{prefix}{key}.")

    walk(config_class, value, "")
    return checks


def literal_values(wheel: ReleaseWheel, path: str, name: str) -> list[str]:
    """The strings of a module-level `Name = Literal[...]` in `path`, following names of other
    such Literals in the same module (`Literal["ngram", EagleModelTypes]`)."""
    aliases: dict[str, ast.expr] = {}
    for node in wheel.tree(path).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name):
                aliases[target.id] = node.value

    def values(alias: str, seen: frozenset[str]) -> list[str]:
        node = aliases.get(alias)
        if alias in seen or not isinstance(node, ast.Subscript):
            return []
        if not (isinstance(node.value, ast.Name) and node.value.id == "Literal"):
            return []
        elements = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        out: list[str] = []
        for element in elements:
            if isinstance(element, ast.Constant) and isinstance(element.value, str):
                out.append(element.value)
            elif isinstance(element, ast.Name):
                out.extend(values(element.id, seen | {alias}))
        return out

    return values(name, frozenset())
