"""Reading facts out of a release's Python source with `ast`, never by executing it.

The shapes recognised here are the ones a release uses to state its runner rules: a method that
collects feature names into a list (`unsupported.append("...")` under `if` conditions, possibly
`extend`-ing another such method's result or returning a literal list early), and a decision
property made of `if ...: return True|False` steps. Conditions are kept as the release spells
them (`ast.unparse`), shortened, so a reader can find them in the file.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass

MAX_CONDITION = 240


def condition_text(conditions: list[str]) -> str:
    """Enclosing conditions joined with `and`, shortened to MAX_CONDITION characters."""
    text = " and ".join(f"({c})" if len(conditions) > 1 else c for c in conditions) or "always"
    return text if len(text) <= MAX_CONDITION else text[: MAX_CONDITION - 3] + "..."


def unparse(node: ast.AST) -> str:
    return " ".join(ast.unparse(node).split())


@dataclass(frozen=True)
class Method:
    """A function definition found in a module, with the class that holds it (if any)."""

    qualname: str
    node: ast.FunctionDef | ast.AsyncFunctionDef

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def line(self) -> int:
        return self.node.lineno


def methods(tree: ast.Module) -> dict[str, Method]:
    """Every top-level function and method of `tree`, by bare name (first definition wins)."""
    found: dict[str, Method] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            found.setdefault(node.name, Method(node.name, node))
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    found.setdefault(item.name, Method(f"{node.name}.{item.name}", item))
    return found


@dataclass(frozen=True)
class Item:
    """One feature a collecting method can report: its text (an f-string keeps its `{...}`
    placeholders), the conditions under which it is reported, and where."""

    text: str
    condition: str
    line: int
    method: str


def _string(node: ast.expr) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts: list[str] = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
            elif isinstance(value, ast.FormattedValue):
                parts.append("{" + unparse(value.value) + "}")
        return "".join(parts)
    return None


def _self_call(node: ast.expr) -> str | None:
    """`name` of a call `self.name()`, else None."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "self"
    ):
        return node.func.attr
    return None


def collected_items(method: Method, known: dict[str, Method], prefix: list[str]) -> list[Item]:
    """The features `method` collects into its list, in source order, following
    `lst.extend(self.other())` into `other` (its conditions added to the ones around the call)
    and `return [literal, ...]` early exits."""
    items: list[Item] = []

    def walk(body: list[ast.stmt], conditions: list[str]) -> None:
        conditions = list(conditions)
        for statement in body:
            if isinstance(statement, ast.If):
                test = unparse(statement.test)
                walk(statement.body, [*conditions, test])
                walk(statement.orelse, [*conditions, f"not ({test})"])
                if _outcome(statement.body) is not None and not statement.orelse:
                    # An early return: what follows runs only when the test was false.
                    conditions.append(f"not ({test})")
            elif isinstance(statement, ast.For | ast.While | ast.With | ast.Try):
                walk(statement.body, conditions)
            elif isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call):
                call = statement.value
                if not isinstance(call.func, ast.Attribute) or not call.args:
                    continue
                if call.func.attr == "append":
                    text = _string(call.args[0])
                    if text is not None:
                        items.append(
                            Item(text, condition_text(conditions), call.lineno, method.qualname)
                        )
                elif call.func.attr == "extend":
                    inner = _self_call(call.args[0])
                    if inner is not None and inner in known:
                        items.extend(collected_items(known[inner], known, conditions))
            elif isinstance(statement, ast.Return) and isinstance(statement.value, ast.List):
                for element in statement.value.elts:
                    text = _string(element)
                    if text is not None:
                        items.append(
                            Item(text, condition_text(conditions), element.lineno, method.qualname)
                        )

    walk(method.node.body, list(prefix))
    return items


@dataclass(frozen=True)
class Step:
    """One step of a decision property: under `condition`, the outcome (`returns True`,
    `returns False`, `returns <expr>`, `raises`), the line, and the local names the condition
    or outcome uses with the value they were assigned (`unsupported` -> `self._get_...()`)."""

    condition: str
    outcome: str
    line: int
    where: dict[str, str]


def _outcome(body: list[ast.stmt]) -> str | None:
    """What a branch ends with: the first return or raise at its own level, else None."""
    for statement in body:
        if isinstance(statement, ast.Return):
            return "returns " + (unparse(statement.value) if statement.value else "None")
        if isinstance(statement, ast.Raise):
            return "raises"
    return None


def decision_steps(method: Method) -> list[Step]:
    """The `if ...: return/raise` steps of `method` in order, with nested ifs flattened into
    their conditions, and the final unconditional return."""
    steps: list[Step] = []
    bindings: dict[str, str] = {}

    def used(*texts: str) -> dict[str, str]:
        words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", " ".join(texts)))
        return {name: value for name, value in bindings.items() if name in words}

    def walk(body: list[ast.stmt], conditions: list[str]) -> None:
        for statement in body:
            if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
                target = statement.targets[0]
                if isinstance(target, ast.Name):
                    bindings[target.id] = unparse(statement.value)
            elif isinstance(statement, ast.If):
                inner = [*conditions, unparse(statement.test)]
                walk(statement.body, inner)
                ending = _outcome(statement.body)
                if ending is not None:
                    text = condition_text(inner)
                    steps.append(Step(text, ending, statement.lineno, used(text, ending)))
                walk(statement.orelse, [*conditions, f"not ({unparse(statement.test)})"])
            elif isinstance(statement, ast.Return) and not conditions:
                ending = _outcome([statement]) or ""
                steps.append(Step("always", ending, statement.lineno, used(ending)))

    walk(method.node.body, [])
    return steps


def calls(method: Method) -> Iterator[str]:
    """Names of `self.<name>(...)` calls anywhere in `method`."""
    for node in ast.walk(method.node):
        if isinstance(node, ast.Call):
            name = _self_call(node)
            if name is not None:
                yield name


def string_constants(node: ast.AST) -> Iterator[str]:
    """Every string literal (an f-string as one, with its placeholders) under `node`."""
    text = _string(node) if isinstance(node, ast.expr) else None
    if text is not None:
        yield text
        return
    for child in ast.iter_child_nodes(node):
        yield from string_constants(child)


def exception_message(exc: ast.expr) -> str:
    """The literal text of a raised exception's positional arguments, whitespace collapsed."""
    parts = exc.args if isinstance(exc, ast.Call) else [exc]
    return " ".join(" ".join(t for part in parts for t in string_constants(part)).split())
