"""Upstream-named flags the operator may pass that this engine version only partly implements.

Each one either works or stops the engine at startup with a ParamError naming the flag and
saying what to do instead; none is accepted and then ignored:
- `--tensor-parallel-size`, `--pipeline-parallel-size`, `--data-parallel-size`: 1 works; this
  engine version runs one GPU per replica (scale out with replicas).
- `--enable-expert-parallel`, `--enable-elastic-ep`, `--enable-dbo`: refused (the engine serves
  dense models on one GPU: no experts to place, no second micro-batch stream).
- `--compilation-config JSON`: parsed; an empty object works, sequence parallelism and any
  other key are refused by name.
- `--speculative-config JSON`: parsed and validated like upstream's (method, token count,
  n-gram window, draft model); speculative decoding is not implemented yet, so a valid
  configuration is refused naming its method.
- `--logits-processors NAME...`: `package.module.Class` or `package.module:attr`; imported and
  registered in the engine's custom logits-processor registry (which selects runner V1 under
  `--runner auto`), and applied to every request.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from davit_engine.types import ParamError

SPECULATIVE_METHODS = (
    "ngram",
    "eagle",
    "eagle3",
    "mtp",
    "draft_model",
    "medusa",
    "mlp_speculator",
)
_SPECULATIVE_KEYS = {
    "method",
    "num_speculative_tokens",
    "model",
    "prompt_lookup_max",
    "prompt_lookup_min",
}


def check_parallelism(
    tensor: int,
    pipeline: int,
    data: int,
    expert: bool = False,
    elastic_ep: bool = False,
    dual_batch_overlap: bool = False,
) -> None:
    """Refuse every multi-GPU layout: this engine version runs one GPU per replica."""
    for flag, size in (
        ("--tensor-parallel-size", tensor),
        ("--pipeline-parallel-size", pipeline),
        ("--data-parallel-size", data),
    ):
        if size < 1:
            raise ParamError(flag, f"must be at least 1, got {size}")
        if size > 1:
            raise ParamError(
                flag,
                f"{size} is not supported: this engine version runs one GPU per replica; use "
                f"{flag} 1 and scale out with replicas (or serve the model with engine type vllm)",
            )
    for flag, on, what in (
        ("--enable-expert-parallel", expert, "expert parallelism"),
        ("--enable-elastic-ep", elastic_ep, "elastic expert parallelism"),
        ("--enable-dbo", dual_batch_overlap, "dual-batch overlap"),
    ):
        if on:
            raise ParamError(
                flag,
                f"{what} is not supported: this engine version serves dense models on one GPU "
                "per replica; remove the flag (or serve the model with engine type vllm)",
            )


def _json_object(flag: str, text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ParamError(flag, f"must be a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise ParamError(flag, f"must be a JSON object, got {type(value).__name__}")
    return value


def check_compilation_config(text: str | None) -> None:
    """`{}` works; sequence parallelism and any other setting are refused by name."""
    if text is None:
        return
    config = _json_object("--compilation-config", text)
    pass_config = config.pop("pass_config", {})
    if not isinstance(pass_config, dict):
        raise ParamError("--compilation-config", "pass_config must be a JSON object")
    if pass_config.get("enable_sequence_parallelism"):
        raise ParamError(
            "--compilation-config",
            "pass_config.enable_sequence_parallelism is not supported: it needs tensor "
            "parallelism, and this engine version runs one GPU per replica",
        )
    unknown = [f"pass_config.{k}" for k in pass_config if k != "enable_sequence_parallelism"]
    unknown += sorted(config)
    if unknown:
        raise ParamError(
            "--compilation-config",
            f"{', '.join(unknown)} is not supported by this engine (it captures CUDA graphs "
            "itself; --enforce-eager turns them off)",
        )


@dataclass(frozen=True)
class SpeculativeConfig:
    """A validated `--speculative-config`."""

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """Parse and validate; ParamError("--speculative-config") names the bad key."""
    flag = "--speculative-config"
    raw = _json_object(flag, text)
    unknown = sorted(set(raw) - _SPECULATIVE_KEYS)
    if unknown:
        raise ParamError(flag, f"unknown key(s) {', '.join(unknown)}")
    method = raw.get("method")
    if method not in SPECULATIVE_METHODS:
        raise ParamError(
            flag, f"method must be one of {', '.join(SPECULATIVE_METHODS)}, got {method!r}"
        )
    tokens = raw.get("num_speculative_tokens")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or not 1 <= tokens <= 16:
        raise ParamError(flag, f"num_speculative_tokens must be an integer 1-16, got {tokens!r}")
    model = raw.get("model")
    if method == "draft_model" and not (isinstance(model, str) and model):
        raise ParamError(flag, "method draft_model needs model (the draft model's ORG/NAME)")
    if model is not None and not isinstance(model, str):
        raise ParamError(flag, f"model must be a string, got {model!r}")
    lookup: dict[str, int | None] = {}
    for key in ("prompt_lookup_max", "prompt_lookup_min"):
        value = raw.get(key)
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            raise ParamError(flag, f"{key} must be a positive integer, got {value!r}")
        if value is not None and method != "ngram":
            raise ParamError(flag, f"{key} only applies to method ngram")
        lookup[key] = value
    low, high = lookup["prompt_lookup_min"], lookup["prompt_lookup_max"]
    if low is not None and high is not None and low > high:
        raise ParamError(flag, f"prompt_lookup_min {low} exceeds prompt_lookup_max {high}")
    return SpeculativeConfig(method, tokens, model, high, low)


def check_speculative_config(text: str | None) -> None:
    """Validate, then refuse: no proposer is implemented in this engine version."""
    if text is None:
        return
    config = parse_speculative_config(text)
    raise ParamError(
        "--speculative-config",
        f"speculative decoding (method {config.method}) is not implemented in this engine "
        "version; remove features.speculative (the flag), or serve with engine type vllm",
    )


def load_logits_processors(names: Sequence[str]) -> None:
    """Import each `module.Class` / `module:attr` and register it under the name as given.

    A class is instantiated without arguments; the result (or a plain function) must be
    callable as `(token_ids, logits[V]) -> logits[V]`.
    """
    # Imported here: the API process checks the other flags without loading torch.
    from davit_engine.runner.sampler import LogitsProcessor, register_logits_processor

    flag = "--logits-processors"
    for name in names:
        module_name, sep, attr = name.partition(":")
        if not sep:
            module_name, _, attr = name.rpartition(".")
        if not module_name or not attr:
            raise ParamError(flag, f"{name!r}: expected package.module.Class or module:attr")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ParamError(flag, f"{name}: cannot import {module_name} ({exc})") from None
        target = getattr(module, attr, None)
        if target is None:
            raise ParamError(flag, f"{name}: {module_name} has no attribute {attr}")
        processor = target() if isinstance(target, type) else target
        if not callable(processor):
            raise ParamError(flag, f"{name}: not callable as (token_ids, logits) -> logits")
        function: LogitsProcessor = processor
        register_logits_processor(name, function)
