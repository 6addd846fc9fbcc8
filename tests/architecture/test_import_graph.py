"""The import graph of the shipped packages: no circles, no upward imports, no cross-talk.

Each package states its layers in its `__init__` docstring, lowest first, as one line
`Layers (lowest first): a, b, c` naming its subpackages and top-level modules. A module may
import modules of its own layer or lower ones; imports inside functions count, imports under
`if TYPE_CHECKING:` count for layering but not for circles (they never run). The operator and
the engine share only the contract; the contract and the dispatcher import neither half.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOTS = {
    "davit_contract": REPO / "contract" / "davit_contract",
    "davit_cli": REPO / "cli" / "davit_cli",
    "davit_engine": REPO / "engine" / "davit_engine",
    "davit_operator": REPO / "operator" / "davit_operator",
}
# Which of our packages each package may import (besides itself).
ALLOWED = {
    "davit_contract": set(),
    "davit_cli": set(),  # it imports the halves by name at run time, never statically
    "davit_engine": {"davit_contract"},
    "davit_operator": {"davit_contract"},
}
OURS = {*ROOTS, "davit_tools"}
LAYERED = ("davit_engine", "davit_operator")


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    type_only: bool


def module_name(package: str, path: Path) -> str:
    parts = list(path.relative_to(ROOTS[package]).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def modules(package: str) -> dict[str, Path]:
    return {module_name(package, p): p for p in sorted(ROOTS[package].rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(name: str, path: Path, known: set[str]) -> list[Edge]:
    """Every import of one of our packages in `path`, resolved to the module it loads."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    edges: list[Edge] = []

    def visit(node: ast.AST, type_only: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, type_only)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                edges.append(Edge(name, alias.name, node.lineno, type_only))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                edges.append(Edge(name, sub if sub in known else target, node.lineno, type_only))
        for child in ast.iter_child_nodes(node):
            visit(child, type_only)

    visit(tree, False)
    return [e for e in edges if e.target.split(".")[0] in OURS]


def all_edges() -> list[Edge]:
    known: set[str] = set()
    files: dict[str, Path] = {}
    for package in ROOTS:
        found = modules(package)
        files.update(found)
        known.update(found)
    return [edge for name, path in files.items() for edge in imports(name, path, known)]


def layers(package: str) -> list[str]:
    doc = ast.get_docstring(ast.parse((ROOTS[package] / "__init__.py").read_text())) or ""
    match = re.search(r"Layers \(lowest first\):\s*([^\n]+(?:\n[ \t]+[^\n]+)*)", doc)
    assert match, f"{package}/__init__.py does not state its layers"
    return [part.strip().rstrip(".") for part in match.group(1).split(",") if part.strip()]


def layer_of(package: str, module: str, order: list[str]) -> int | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None  # the package's own __init__
    return order.index(parts[1]) if parts[1] in order else -1


def test_packages_import_only_what_they_may() -> None:
    wrong = [
        f"{e.source}:{e.line} imports {e.target}"
        for e in all_edges()
        if (theirs := e.target.split(".")[0]) != (mine := e.source.split(".")[0])
        and theirs not in ALLOWED[mine]
    ]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("package", LAYERED)
def test_every_module_belongs_to_a_layer(package: str) -> None:
    order = layers(package)
    assert len(set(order)) == len(order), f"{package} names a layer twice: {order}"
    tops = {n.split(".")[1] for n in modules(package) if n.count(".") >= 1}
    assert not tops - set(order), f"{package}: not in any layer: {sorted(tops - set(order))}"
    assert not set(order) - tops, f"{package}: layers without a module: {set(order) - tops}"


@pytest.mark.parametrize("package", LAYERED)
def test_no_upward_imports(package: str) -> None:
    order = layers(package)
    wrong = []
    for e in all_edges():
        if e.source.split(".")[0] != package or e.target.split(".")[0] != package:
            continue
        source, target = layer_of(package, e.source, order), layer_of(package, e.target, order)
        if source is None or target is None:
            continue
        if target > source:
            wrong.append(
                f"{e.source}:{e.line} ({order[source]}) imports {e.target} ({order[target]})"
            )
    assert not wrong, "\n".join(wrong)


def test_no_import_circles() -> None:
    graph: dict[str, set[str]] = {}
    for e in all_edges():
        if not e.type_only and e.source != e.target:
            graph.setdefault(e.source, set()).add(e.target)
    cycles = strongly_connected(graph)
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm; returns the components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def test_the_checker_sees_a_circle_and_an_upward_import() -> None:
    """The walk itself: a two-module circle is found, and a plain graph has none."""
    assert strongly_connected({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert strongly_connected({"a": {"b"}, "b": {"c"}}) == []
    order = ["low", "high"]
    assert layer_of("p", "p.high.x", order) == 1 and layer_of("p", "p.low", order) == 0
