"""The command lines checked against one vLLM release: the operator's, and probes of the release.

The operator's: one per example in `examples/*.yaml` and one per typed feature (each branch of
the operator's argument builder, each speculative method of the API), every one planned by the
operator's own planner as `engine.type: vllm` at the release under check (the arguments and the
runner variable depend on the release). Where the planner refuses the spec, the line is the one
the argument builder writes for that release (`engine_invocation`, as the engine contract test
does), with the refusal recorded; where the builder itself refuses (a setting the release does
not have), the line is empty. `tests/tools/catalog/test_command_lines.py` checks that these
lines still equal the committed evidence, so a change to the operator's arguments shows up as a
stale evidence file until the tool is run again.

Probes, set by hand to record what the release does with a setting whatever the operator emits:
the runner variable at each value (`switch:`), and each candidate sequence-parallelism key of
the compilation pass config (`probe:`).

All imports of the operator are here, so a change of its layout touches one module.
"""

from __future__ import annotations

import copy
import json
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from davit_operator.api.spec import (
    InferenceServiceSpec,
    KvCacheDType,
    Quantization,
    SpeculativeMethod,
)
from davit_operator.catalog.loader import Catalog, load_catalog
from davit_operator.planning.args import engine_invocation
from davit_operator.planning.errors import PlanError
from davit_operator.planning.plan import make_plan
from davit_operator.planning.runner import SelectedRunner

REPO_ROOT = Path(__file__).resolve().parents[3]
EXAMPLES_DIR = REPO_ROOT / "examples"
BASE: dict[str, Any] = {
    "model": {"source": "hf://Qwen/Qwen3-8B", "revision": "main"},
    "engine": {"type": "vllm"},
    "accelerator": {"vendor": "nvidia", "product": "NVIDIA-H200"},
}
SWITCH = "VLLM_USE_V2_MODEL_RUNNER"
# Sequence-parallelism keys of the compilation pass config that some release used or that the
# operator once emitted.
PASS_CONFIG_KEYS = ("enable_sp", "enable_sequence_parallelism")


@dataclass(frozen=True)
class CommandLine:
    """A named command line: `args` after the command (`vllm serve`; empty when the operator's
    builder refuses the spec for the release), the container env (what the operator sets, or
    the probe's variable), and the planner's verdict under the current catalog (`accepted`,
    `refused: Reason: message`, or `not planned` for a probe)."""

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
    release = engine.facts_for(spec.engine.version)
    if release is None:
        raise ValueError(f"{name}: {spec.engine.version} is not a release in the catalog")
    forced = spec.engine.runner
    runner = SelectedRunner(release.default_runner if forced == "auto" else forced, "", False)
    try:
        plan = make_plan("evidence", "default", spec, catalog)
    except PlanError as refused:
        verdict = f"refused: {refused.reason}: {refused}"
        try:
            invocation = engine_invocation(spec, engine, release, runner)
        except PlanError:
            return CommandLine(name, origin, list(engine.command), [], {}, verdict)
    else:
        invocation = plan.invocation
        verdict = "accepted"
    env = {e["name"]: str(e.get("value", "")) for e in invocation.env if "value" in e}
    return CommandLine(name, origin, list(invocation.command), list(invocation.args), env, verdict)


def _spec(name: str, overrides: dict[str, Any], version: str) -> InferenceServiceSpec:
    document = _merge(BASE, {"engine": {"version": version}})
    try:
        return InferenceServiceSpec.model_validate(_merge(document, overrides))
    except ValidationError as invalid:
        raise ValueError(f"{name}: the spec is not valid: {invalid}") from invalid


def probe_lines(version: str, catalog: Catalog) -> list[CommandLine]:
    """The release's handling of the runner variable at each value, and of each candidate
    sequence-parallelism key, on the plain typed-feature line."""
    plain = _plan("plain", "", _spec("plain", {}, version), catalog)
    lines = [
        CommandLine(
            f"switch:{SWITCH}={value}",
            "the runner variable, set by hand: does the release read it, refuse it, ignore it",
            plain.command,
            plain.args,
            {**plain.env, SWITCH: value},
            "not planned",
        )
        for value in ("0", "1")
    ]
    tp2 = _plan("tp2", "", _spec("tp2", {"parallelism": {"tensor": 2}}, version), catalog)
    for key in PASS_CONFIG_KEYS:
        config = json.dumps({"pass_config": {key: True}}, sort_keys=True, separators=(",", ":"))
        lines.append(
            CommandLine(
                f"probe:pass_config.{key}",
                "a sequence-parallelism key, set by hand: does the release's parser accept it",
                tp2.command,
                [*tp2.args, "--compilation-config", config],
                tp2.env,
                "not planned",
            )
        )
    return lines


def operator_command_lines(
    version: str, examples_dir: Path = EXAMPLES_DIR, catalog: Catalog | None = None
) -> list[CommandLine]:
    """Every example's and every typed feature's vLLM command line planned at `version`
    (examples first), then the probes."""
    catalog = catalog or load_catalog()
    lines: list[CommandLine] = []
    for path in sorted(examples_dir.glob("*.yaml")):
        document = yaml.safe_load(path.read_text())
        example = _merge(document["spec"], {"engine": {"type": "vllm", "version": version}})
        origin = f"examples/{path.name} (planned as engine.type vllm {version})"
        spec = InferenceServiceSpec.model_validate(example)
        lines.append(_plan(f"example:{path.stem}", origin, spec, catalog))
    for name, overrides in typed_features().items():
        spec = _spec(f"typed feature {name}", overrides, version)
        lines.append(_plan(f"feature:{name}", "typed feature", spec, catalog))
    return lines + probe_lines(version, catalog)


def emitted_flags(lines: list[CommandLine]) -> list[str]:
    """Every flag any of the command lines uses, sorted."""
    return sorted({arg for line in lines for arg in line.args if arg.startswith("--")})


def operator_speculative_methods() -> list[str]:
    """The speculative methods of the operator's API."""
    return list(typing.get_args(SpeculativeMethod))


def operator_precision_values() -> dict[str, list[str]]:
    """The values of the operator's `engine.quantization` and `engine.kvCacheDtype` that it
    passes as flags (`auto`, the model dtype, passes none)."""
    return {
        "quantization": list(typing.get_args(Quantization)),
        "kvCacheDtype": [v for v in typing.get_args(KvCacheDType) if v != "auto"],
    }
