"""The release's own runner rules: how it picks a runner and what each runner cannot run.

Read from `vllm/config/vllm.py` (class `VllmConfig`) with `ast`:
- the decision: the steps of the `use_v2_model_runner` property, when the release has one;
- feature lists: every method named `_get_*unsupported_features` (what V2 does not support yet,
  what V1 does not support, what dual-batch overlap cannot be combined with, what the standalone
  CPU runner refuses, ...), each feature with the condition that reports it, and what the
  release does with the list (`consumers`: the step that selects V1 or refuses);
- validations: where `_validate_*model_runner` runs and under which condition;
- guards: anywhere in the package, a `raise` under a condition on `use_v2_model_runner` (a
  feature that needs one runner).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from davit_tools.catalog.pysource import (
    Item,
    Method,
    Step,
    collected_items,
    condition_text,
    decision_steps,
    exception_message,
    methods,
    unparse,
)
from davit_tools.catalog.wheel import ReleaseWheel

CONFIG = "vllm/config/vllm.py"
DECISION = "use_v2_model_runner"
_LIST_METHOD = re.compile(r"^_get_\w*unsupported_features$")
_VALIDATION = re.compile(r"^_validate_\w*model_runner$")
_PLATFORM_CALL = re.compile(r"current_platform\.(\w+)\(\)")

# Release feature texts that name one of the operator catalog's features (davit_operator
# FeatureName). A tool-side reading aid for phase B, not a fact read from the artifact.
CATALOG_FEATURES = {
    "sequence parallelism": "sequenceParallelism",
    "dual batch overlap": "dualBatchOverlap",
    "elastic expert parallelism": "elasticExpertParallelism",
    "custom logits processors": "customLogitsProcessors",
}


def catalog_feature(text: str) -> str | None:
    """The catalog feature a release feature text names, matching the text or its head before
    ` with ` (`dual batch overlap with LoRA` -> dualBatchOverlap)."""
    return CATALOG_FEATURES.get(text) or CATALOG_FEATURES.get(text.split(" with ", 1)[0])


@dataclass(frozen=True)
class Consumer:
    """A step of a method that acts on a feature list: `when_empty` when its condition holds
    for an empty list (`not v1_unsupported`), else it acts on a non-empty one."""

    method: str
    condition: str
    outcome: str
    line: int
    when_empty: bool


@dataclass(frozen=True)
class FeatureList:
    """A `_get_*unsupported_features` method: its features (lists it extends inlined), the
    methods that extend it, and the steps that act on its result."""

    method: str
    line: int
    items: list[Item]
    extended_by: list[str]
    consumers: list[Consumer]


def _config_methods(wheel: ReleaseWheel) -> dict[str, Method]:
    return methods(wheel.tree(CONFIG)) if wheel.has(CONFIG) else {}


def _consumers(name: str, known: dict[str, Method]) -> list[Consumer]:
    """Steps of any method whose condition or outcome uses a local bound to `self.name()`."""
    call = f"self.{name}()"
    found: list[Consumer] = []
    for method in known.values():
        for step in decision_steps(method):
            bound = [local for local, value in step.where.items() if value == call]
            if bound:
                empty = any(re.search(rf"\bnot \(?{local}\b", step.condition) for local in bound)
                found.append(
                    Consumer(method.qualname, step.condition, step.outcome, step.line, empty)
                )
    return found


def feature_lists(wheel: ReleaseWheel) -> list[FeatureList]:
    known = _config_methods(wheel)
    lists: list[FeatureList] = []
    for name, method in known.items():
        if not _LIST_METHOD.match(name):
            continue
        extended_by = sorted(
            other.qualname
            for other in known.values()
            if other is not method and _extends(other, name)
        )
        lists.append(
            FeatureList(
                method=method.qualname,
                line=method.line,
                items=collected_items(method, known, []),
                extended_by=extended_by,
                consumers=_consumers(name, known),
            )
        )
    return sorted(lists, key=lambda f: f.line)


def _extends(method: Method, name: str) -> bool:
    for node in ast.walk(method.node):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "extend"
            and node.args
            and unparse(node.args[0]) == f"self.{name}()"
        ):
            return True
    return False


def decision(wheel: ReleaseWheel) -> tuple[str, list[Step]] | None:
    """(qualified name, steps) of the runner decision property, None when the release has none."""
    method = _config_methods(wheel).get(DECISION)
    return (method.qualname, decision_steps(method)) if method is not None else None


@dataclass(frozen=True)
class Site:
    """A place in the source: method, line, the condition around it and what it says/does."""

    source: str
    method: str
    line: int
    condition: str
    text: str


def _walk_sites(
    wheel: ReleaseWheel, path: str, wanted: type[ast.stmt], match: re.Pattern[str] | None
) -> list[Site]:
    """Statements of type `wanted` in every method of `path`, with their enclosing conditions;
    for Raise the text is the message, for Expr calls the called name (kept if `match`es)."""
    sites: list[Site] = []
    for method in methods(wheel.tree(path)).values():

        def walk(body: list[ast.stmt], conditions: list[str], qualname: str) -> None:
            for statement in body:
                if isinstance(statement, ast.If):
                    test = unparse(statement.test)
                    walk(statement.body, [*conditions, test], qualname)
                    walk(statement.orelse, [*conditions, f"not ({test})"], qualname)
                elif isinstance(statement, ast.For | ast.While | ast.With | ast.Try):
                    walk(statement.body, conditions, qualname)
                elif isinstance(statement, wanted):
                    text = _site_text(statement)
                    if text is not None and (match is None or match.search(text)):
                        sites.append(
                            Site(path, qualname, statement.lineno, condition_text(conditions), text)
                        )

        walk(method.node.body, [], method.qualname)
    return sites


def _site_text(statement: ast.stmt) -> str | None:
    if isinstance(statement, ast.Raise) and statement.exc is not None:
        return exception_message(statement.exc)
    if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call):
        func = statement.value.func
        if isinstance(func, ast.Attribute):
            return func.attr
    return None


def validations(wheel: ReleaseWheel) -> list[Site]:
    """Calls of `self._validate_*model_runner()` in VllmConfig with their conditions."""
    if not wheel.has(CONFIG):
        return []
    return [s for s in _walk_sites(wheel, CONFIG, ast.Expr, _VALIDATION)]


def runner_guards(wheel: ReleaseWheel) -> list[Site]:
    """Every `raise` anywhere in the package under a condition on `use_v2_model_runner`."""
    sites: list[Site] = []
    for path in wheel.python_files("vllm/"):
        if DECISION not in wheel.read_text(path):
            continue
        sites.extend(
            site for site in _walk_sites(wheel, path, ast.Raise, None) if DECISION in site.condition
        )
    return sites


def needs_runner(site: Site) -> str:
    """`v2` when the guard raises because V2 is not in use, else `v1`."""
    negated = re.search(rf"not \(?\s*[\w.()]*{DECISION}\b", site.condition)
    return "v2" if negated else "v1"


def platform_predicates(wheel: ReleaseWheel, conditions: list[str]) -> list[Site]:
    """For each `current_platform.name()` in `conditions`, every platform's definition of
    `name` in vllm/platforms/ with what it returns."""
    names = sorted({m for c in conditions for m in _PLATFORM_CALL.findall(c)})
    found: list[Site] = []
    for path in wheel.python_files("vllm/platforms/"):
        known = methods(wheel.tree(path))
        for name in names:
            method = known.get(name)
            if method is None:
                continue
            for step in decision_steps(method):
                found.append(Site(path, method.qualname, step.line, step.condition, step.outcome))
    return found


# Config attributes through which a runner would act on each operator catalog feature; a
# reading aid (which runner code touches the feature), not a statement of support.
FEATURE_ATTRIBUTES = {
    "customLogitsProcessors": ("logits_processors",),
    "dualBatchOverlap": ("enable_dbo", "use_ubatching"),
    "elasticExpertParallelism": ("enable_elastic_ep",),
    "sequenceParallelism": ("enable_sp", "enable_sequence_parallelism"),
}
# MRV1's own files (the worker, gpu_worker.py, serves both runners) and MRV2's package.
RUNNER_CODE = {
    "v1": (
        "vllm/v1/worker/gpu_model_runner.py",
        "vllm/v1/worker/gpu_input_batch.py",
        "vllm/v1/worker/gpu_ubatch_wrapper.py",
    ),
    "v2": ("vllm/v1/worker/gpu/",),
}
MAX_READS = 5


def runner_reads(wheel: ReleaseWheel) -> dict[str, dict[str, list[str]]]:
    """Catalog feature -> runner kind -> up to MAX_READS `file:line` where that runner's code
    reads one of the feature's config attributes."""
    out: dict[str, dict[str, list[str]]] = {}
    for feature, attributes in FEATURE_ATTRIBUTES.items():
        out[feature] = {}
        for kind, prefixes in RUNNER_CODE.items():
            found: list[str] = []
            for path in wheel.python_files("vllm/v1/worker/"):
                if not path.startswith(prefixes):
                    continue
                if not any(a in wheel.read_text(path) for a in attributes):
                    continue
                for node in ast.walk(wheel.tree(path)):
                    if isinstance(node, ast.Attribute) and node.attr in attributes:
                        found.append(f"{path}:{node.lineno}")
            out[feature][kind] = sorted(set(found), key=_path_line)[:MAX_READS]
    return out


def _path_line(entry: str) -> tuple[str, int]:
    path, _, line = entry.rpartition(":")
    return path, int(line)
