"""The operator's vLLM command lines, produced by the operator's own planner.

One command line per example in `examples/*.yaml` (an example written for the Davit engine is
planned as `engine.type: vllm`) and per typed feature (each branch of the operator's argument
builder, each speculative method of the API). The planner (`make_plan`) is used where it
accepts the spec under the current catalog; where it refuses (a feature the catalog says no
runner of that release serves), the command line is the one the argument builder would write
(`engine_invocation`, as the engine contract test does), and the refusal is recorded with it.

All imports of the operator are here, so a change of its layout touches one module.
"""

from __future__ import annotations

import copy
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from davit_operator.api.spec import InferenceServiceSpec, SpeculativeMethod
from davit_operator.catalog.loader import Catalog, load_catalog
from davit_operator.planning.args import engine_invocation
from davit_operator.planning.errors import PlanError
from davit_operator.planning.plan import make_plan
from davit_operator.planning.runner import SelectedRunner

REPO_ROOT = Path(__file__).resolve().parents[3]
EXAMPLES_DIR = REPO_ROOT / "examples"
# Typed features are planned against this catalog release; the argument builder reads no
# engine version, so the command line is the same for every release.
PLANNED_VERSION = "0.33.0"
BASE: dict[str, Any] = {
    "model": {"source": "hf://Qwen/Qwen3-8B", "revision": "main"},
    "engine": {"type": "vllm", "version": PLANNED_VERSION},
    "accelerator": {"vendor": "nvidia", "product": "NVIDIA-H200"},
}


@dataclass(frozen=True)
class CommandLine:
    """A named operator command line: `args` after the command (`vllm serve`), the container
    env the planner sets (for a refused spec the builder's env without a runner variable; for a
    forced runner the builder's env with it), and the planner's verdict under the current
    catalog (`accepted`, or `refused: Reason: message`)."""

    name: str
    origin: str
    command: list[str]
    args: list[str]
    env: dict[str, str]
    planner: str


def _merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def typed_features() -> dict[str, dict[str, Any]]:
    """Name -> spec overrides on BASE: one per branch of the operator's argument builder."""
    features: dict[str, dict[str, Any]] = {
        "plain": {},
        "served-name": {"model": {"servedName": "qwen3-8b"}},
        "pvc-directory": {"model": {"source": "pvc://weights/qwen3-8b", "revision": None}},
        "pvc-gguf-file": {
            "model": {"source": "pvc://models/smollm2", "revision": None, "file": "q4.gguf"}
        },
        "random-weights": {"model": {"source": "random://Qwen/Qwen3-0.6B", "revision": None}},
        "tensor-parallel": {"parallelism": {"tensor": 2}},
        "pipeline-parallel": {"parallelism": {"pipeline": 2}},
        "data-parallel": {"parallelism": {"data": 2}},
        "expert-parallel": {"parallelism": {"tensor": 2, "expert": {"enabled": True}}},
        "elastic-expert-parallel": {
            "parallelism": {"tensor": 2, "expert": {"enabled": True, "elastic": True}}
        },
        "dual-batch-overlap": {"parallelism": {"dualBatchOverlap": True}},
        "dual-batch-overlap-pipeline": {"parallelism": {"pipeline": 2, "dualBatchOverlap": True}},
        "sequence-parallelism": {"parallelism": {"tensor": 2, "sequenceParallelism": True}},
        "limits": {
            "limits": {
                "maxModelLen": 8192,
                "maxNumSeqs": 64,
                "maxNumBatchedTokens": 4096,
                "gpuMemoryUtilization": 0.85,
            }
        },
        "kv-cache-bytes": {"limits": {"kvCacheMemoryBytes": 8 * 1024**3}},
        "no-prefix-caching": {"features": {"prefixCaching": False}},
        "custom-logits-processors": {"features": {"customLogitsProcessors": ["json.JSONDecoder"]}},
        "runner-v2": {"engine": {"runner": "v2"}},
        "runner-v1": {"engine": {"runner": "v1"}},
        "extra-args": {"engine": {"extraArgs": ["--enforce-eager"]}},
        "cpu": {
            "model": {"source": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"},
            "accelerator": {"vendor": "cpu", "product": None},
        },
    }
    for method in typing.get_args(SpeculativeMethod):
        speculative: dict[str, Any] = {"method": method, "numSpeculativeTokens": 3}
        if method == "ngram":
            speculative.update(promptLookupMax=4, promptLookupMin=2)
        else:
            speculative["draftModel"] = "Qwen/Qwen3-0.6B"
        features[f"speculative-{method}"] = {"features": {"speculative": speculative}}
    return features


def _plan(name: str, origin: str, spec: InferenceServiceSpec, catalog: Catalog) -> CommandLine:
    engine = catalog.engines.engines[spec.engine.type]
    forced = spec.engine.runner
    runner = SelectedRunner("v2" if forced == "auto" else forced, "", False)
    try:
        plan = make_plan("evidence", "default", spec, catalog)
    except PlanError as refused:
        # One release runner: the builder adds no runner variable (phase B decides that).
        invocation = engine_invocation(spec, engine, runner, 1)
        verdict = f"refused: {refused.reason}: {refused}"
    else:
        invocation = plan.invocation
        verdict = "accepted"
    if forced != "auto":
        # A forced runner: the variable the builder sets while it believes the release still
        # has two runners, so every release's handling of it is on record.
        invocation = engine_invocation(spec, engine, runner, 2)
    env = {e["name"]: str(e.get("value", "")) for e in invocation.env if "value" in e}
    return CommandLine(name, origin, list(invocation.command), list(invocation.args), env, verdict)


def operator_command_lines(
    examples_dir: Path = EXAMPLES_DIR, catalog: Catalog | None = None
) -> list[CommandLine]:
    """Every example's and every typed feature's vLLM command line, examples first."""
    catalog = catalog or load_catalog()
    lines: list[CommandLine] = []
    for path in sorted(examples_dir.glob("*.yaml")):
        document = yaml.safe_load(path.read_text())
        spec = document["spec"]
        origin = f"examples/{path.name}"
        if spec["engine"]["type"] != "vllm":
            spec = _merge(spec, {"engine": {"type": "vllm", "version": PLANNED_VERSION}})
            origin += " (planned as engine.type vllm)"
        lines.append(
            _plan(
                f"example:{path.stem}", origin, InferenceServiceSpec.model_validate(spec), catalog
            )
        )
    for name, overrides in typed_features().items():
        try:
            spec = InferenceServiceSpec.model_validate(_merge(BASE, overrides))
        except ValidationError as invalid:
            raise ValueError(f"typed feature {name}: the spec is not valid: {invalid}") from invalid
        lines.append(_plan(f"feature:{name}", "typed feature", spec, catalog))
    return lines


def emitted_flags(lines: list[CommandLine]) -> list[str]:
    """Every flag any of the command lines uses, sorted."""
    return sorted({arg for line in lines for arg in line.args if arg.startswith("--")})


def operator_speculative_methods() -> list[str]:
    """The speculative methods of the operator's API."""
    return list(typing.get_args(SpeculativeMethod))
