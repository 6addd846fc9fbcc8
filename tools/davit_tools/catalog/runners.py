"""Which model runners a release ships and which switch it reads to choose between them.

Runner V1 (MRV1) is the class `GPUModelRunner` in `vllm/v1/worker/gpu_model_runner.py`, runner V2
(MRV2) the class `GPUModelRunner` in `vllm/v1/worker/gpu/model_runner.py`. Every other runner class
under `vllm/v1/worker/` (CPU, XPU, encoder-only) is classified by the root it derives from,
following its base classes through the module's imports; one deriving from neither is
`standalone`. The switch is the environment variable the release declares in `vllm/envs.py` and
the code that reads it.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from davit_tools.catalog.pysource import exception_message, methods, unparse
from davit_tools.catalog.wheel import ReleaseWheel

WORKER_DIR = "vllm/v1/worker/"
ROOTS = {
    ("vllm/v1/worker/gpu_model_runner.py", "GPUModelRunner"): "v1",
    ("vllm/v1/worker/gpu/model_runner.py", "GPUModelRunner"): "v2",
}
SWITCH = "VLLM_USE_V2_MODEL_RUNNER"
ENVS = "vllm/envs.py"
_RUNNER_CLASS = re.compile(r"ModelRunner(V\d+)?$")


def module_path(wheel: ReleaseWheel, dotted: str) -> str | None:
    """The wheel member of an absolute module name, if the wheel has it."""
    base = dotted.replace(".", "/")
    for candidate in (f"{base}.py", f"{base}/__init__.py"):
        if wheel.has(candidate):
            return candidate
    return None


def _imported_names(wheel: ReleaseWheel, tree: ast.Module) -> dict[str, tuple[str, str]]:
    """Local name -> (wheel member, original name) for every `from X import Y [as Z]`."""
    names: dict[str, tuple[str, str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            path = module_path(wheel, node.module)
            if path is None:
                continue
            for alias in node.names:
                names[alias.asname or alias.name] = (path, alias.name)
    return names


def _classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


@dataclass(frozen=True)
class Runner:
    """A runner class the release ships: `kind` is v1, v2 or standalone."""

    kind: str
    device: str
    class_name: str
    source: str
    line: int
    lineage: list[str]


def _device(path: str, class_name: str) -> str:
    text = f"{path} {class_name}".lower()
    for device in ("cpu", "xpu", "tpu"):
        if device in text:
            return device
    return "gpu"


def _lineage(
    wheel: ReleaseWheel, path: str, class_name: str, seen: frozenset[tuple[str, str]]
) -> list[str]:
    """`path:Class` of the class and each base up to a root runner or a class the wheel does
    not define; empty when no root is reached."""
    key = (path, class_name)
    if key in ROOTS:
        return [f"{path}:{class_name}"]
    if key in seen or not wheel.has(path):
        return []
    tree = wheel.tree(path)
    node = _classes(tree).get(class_name)
    if node is None:
        return []
    imported = _imported_names(wheel, tree)
    for base in node.bases:
        if not isinstance(base, ast.Name):
            continue
        target = (path, base.id) if base.id in _classes(tree) else imported.get(base.id)
        if target is None:
            continue
        rest = _lineage(wheel, target[0], target[1], seen | {key})
        if rest:
            return [f"{path}:{class_name}", *rest]
    return []


def shipped_runners(wheel: ReleaseWheel) -> list[Runner]:
    """Every model runner class under vllm/v1/worker/, classified by its root."""
    runners: list[Runner] = []
    for path in wheel.python_files(WORKER_DIR):
        for name, node in _classes(wheel.tree(path)).items():
            if not _RUNNER_CLASS.search(name) or "Mixin" in name:
                continue
            lineage = _lineage(wheel, path, name, frozenset())
            kind = ROOTS[_root_key(lineage[-1])] if lineage else "standalone"
            runners.append(Runner(kind, _device(path, name), name, path, node.lineno, lineage))
    return runners


def _root_key(entry: str) -> tuple[str, str]:
    path, _, name = entry.partition(":")
    return (path, name)


@dataclass(frozen=True)
class Switch:
    """How the release lets a user force a runner: the environment variable as `vllm/envs.py`
    declares it (None when it no longer does), how it is parsed and its default, which
    functions read it, and the messages of code that refuses or ignores it."""

    name: str
    declared: bool
    parse: str | None
    default: str | None
    readers: list[str]
    messages: list[tuple[str, int, str]]


def _declaration(wheel: ReleaseWheel) -> tuple[str | None, str | None]:
    """(parse expression, default) of SWITCH in the `environment_variables` mapping."""
    for node in ast.walk(wheel.tree(ENVS)):
        if not isinstance(node, ast.Dict):
            continue
        for key, value in zip(node.keys, node.values, strict=True):
            if isinstance(key, ast.Constant) and key.value == SWITCH:
                body = value.body if isinstance(value, ast.Lambda) else value
                default = None
                for call in ast.walk(body):
                    if (
                        isinstance(call, ast.Call)
                        and isinstance(call.func, ast.Attribute)
                        and call.func.attr == "getenv"
                        and len(call.args) == 2
                    ):
                        default = unparse(call.args[1])
                return unparse(body), default
    return None, None


def _reads_switch(node: ast.AST, path: str) -> bool:
    """`envs.SWITCH`, or outside envs.py a comparison with the literal name (a check of
    os.environ's keys)."""
    if isinstance(node, ast.Attribute):
        return node.attr == SWITCH
    return (
        isinstance(node, ast.Compare)
        and path != ENVS
        and any(isinstance(c, ast.Constant) and c.value == SWITCH for c in node.comparators)
    )


def runner_switch(wheel: ReleaseWheel) -> Switch:
    parse, default = _declaration(wheel)
    readers: set[str] = set()
    messages: list[tuple[str, int, str]] = []
    for path in wheel.python_files("vllm/"):
        if SWITCH not in wheel.read_text(path):
            continue
        tree = wheel.tree(path)
        for method in methods(tree).values():
            for node in ast.walk(method.node):
                if _reads_switch(node, path):
                    readers.add(f"{path}:{method.qualname}")
                elif isinstance(node, ast.Raise) and node.exc is not None:
                    text = exception_message(node.exc)
                    if SWITCH in text:
                        messages.append((path, node.lineno, text))
    return Switch(
        name=SWITCH,
        declared=parse is not None,
        parse=parse,
        default=default,
        readers=sorted(readers),
        messages=sorted(messages),
    )
