"""The release's compilation pass config (`PassConfig` in vllm/config/), read from its source.

The operator turns sequence parallelism on through `--compilation-config` with a pass-config key;
the key changed between releases and later disappeared, so the evidence records every field of
the class and names the one that switches sequence parallelism on: a `bool` field whose
docstring begins with "Enable sequence parallelism". That naming is the tool's reading; the
probe lines of the contract check (`probe:pass_config.KEY`) show what the release's parser
makes of each candidate key.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from davit_tools.catalog.pysource import unparse
from davit_tools.catalog.wheel import ReleaseWheel

CLASS = "PassConfig"
SEQUENCE_PARALLELISM_DOC = "enable sequence parallelism"


@dataclass(frozen=True)
class ConfigField:
    name: str
    annotation: str
    line: int
    doc: str


def _first_sentence(text: str) -> str:
    flat = " ".join(text.split())
    head, dot, _ = flat.partition(". ")
    return head + ("." if dot else "")


def config_fields(
    wheel: ReleaseWheel, class_name: str
) -> tuple[str, int, list[ConfigField]] | None:
    """(file, line, fields) of `class_name` among vllm/config/*.py, each annotated field with
    the first sentence of the docstring that follows it."""
    for path in wheel.python_files("vllm/config/"):
        for node in wheel.tree(path).body:
            if not (isinstance(node, ast.ClassDef) and node.name == class_name):
                continue
            fields: list[ConfigField] = []
            body = node.body
            for index, item in enumerate(body):
                if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                    continue
                following = body[index + 1] if index + 1 < len(body) else None
                doc = ""
                if (
                    isinstance(following, ast.Expr)
                    and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)
                ):
                    doc = _first_sentence(following.value.value)
                fields.append(
                    ConfigField(item.target.id, unparse(item.annotation), item.lineno, doc)
                )
            return path, node.lineno, fields
    return None


def sequence_parallelism_key(fields: list[ConfigField]) -> str | None:
    """The bool field whose docstring begins with "Enable sequence parallelism", if any."""
    for field in fields:
        is_bool = "bool" in field.annotation.replace(" ", "").split("|")
        if is_bool and field.doc.lower().startswith(SEQUENCE_PARALLELISM_DOC):
            return field.name
    return None
