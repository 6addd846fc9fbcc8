"""Upstream-named flags the operator may pass that this engine version only partly implements.

Each one either works or stops the engine at startup with a ParamError naming the flag and
saying what to do instead; none is accepted and then ignored:
- `--tensor-parallel-size N`: 1 to 8 work (davit_engine.rank_workers; a size that does not
  divide the model's heads is refused once the model is known).
- `--pipeline-parallel-size`, `--data-parallel-size`: 1 works; this engine version splits a
  model over the GPUs of one replica by tensor parallelism only (scale out with replicas).
- `--enable-expert-parallel`, `--enable-elastic-ep`, `--enable-dbo`: refused (the engine serves
  dense models on one GPU: no experts to place, no second micro-batch stream).
- `--compilation-config JSON`: parsed; an empty object works, sequence parallelism and any
  other key are refused by name.
- `--speculative-config JSON`: upstream's keys and meanings (`spec_decode/config.py`);
  methods `ngram` and `draft_model` with `standard` (strict), `fly` or `synthetic` verification
  run on runner V2; any other method, `block` verification, and every invalid key are refused
  by name.
- `--logits-processors NAME...`: `package.module.Class` or `package.module:attr`; imported and
  registered in the engine's custom logits-processor registry (which selects runner V1 under
  `--runner auto`), and applied to every request.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Sequence
from typing import Any

from davit_engine.config import MAX_TENSOR_PARALLEL_SIZE
from davit_engine.spec_decode.config import (
    FLAG,
    SPECULATIVE_METHODS,
    SpeculativeConfig,
    speculative_config_from_json,
)
from davit_engine.types import ParamError


def check_parallelism(
    tensor: int,
    pipeline: int,
    data: int,
    expert: bool = False,
    elastic_ep: bool = False,
    dual_batch_overlap: bool = False,
) -> None:
    """Refuse every multi-GPU layout but tensor parallelism of at most
    MAX_TENSOR_PARALLEL_SIZE ranks."""
    if not 1 <= tensor <= MAX_TENSOR_PARALLEL_SIZE:
        raise ParamError(
            "--tensor-parallel-size",
            f"must be between 1 and {MAX_TENSOR_PARALLEL_SIZE} (the GPUs of one host: the ranks "
            f"are processes of one pod), got {tensor}",
        )
    for flag, size in (
        ("--pipeline-parallel-size", pipeline),
        ("--data-parallel-size", data),
    ):
        if size < 1:
            raise ParamError(flag, f"must be at least 1, got {size}")
        if size > 1:
            raise ParamError(
                flag,
                f"{size} is not supported: this engine version splits a model over GPUs by "
                f"--tensor-parallel-size only; use {flag} 1 and scale out with replicas (or "
                "serve the model with engine type vllm)",
            )
    for flag, on, what in (
        ("--enable-expert-parallel", expert, "expert parallelism"),
        ("--enable-elastic-ep", elastic_ep, "elastic expert parallelism"),
        ("--enable-dbo", dual_batch_overlap, "dual-batch overlap"),
    ):
        if on:
            raise ParamError(
                flag,
                f"{what} is not supported: this engine version serves dense models (no "
                "experts, one micro-batch stream); remove the flag (or serve the model with engine type vllm)",
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
            "parallelism's sequence-parallel pass, which this engine version does not implement",
        )
    unknown = [f"pass_config.{k}" for k in pass_config if k != "enable_sequence_parallelism"]
    unknown += sorted(config)
    if unknown:
        raise ParamError(
            "--compilation-config",
            f"{', '.join(unknown)} is not supported by this engine (it captures CUDA graphs "
            "itself; --enforce-eager turns them off)",
        )


__all__ = ["SPECULATIVE_METHODS", "check_speculative_config", "parse_speculative_config"]


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """Parse and validate upstream's JSON; ParamError("--speculative-config") names the bad key
    (and refuses, by name, a method or verification this engine does not implement)."""
    return speculative_config_from_json(_json_object(FLAG, text))


def check_speculative_config(text: str | None) -> SpeculativeConfig | None:
    """The validated configuration, or None without the flag."""
    return None if text is None else parse_speculative_config(text)


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
