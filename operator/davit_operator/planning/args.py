"""Engine command line, environment and model volumes for the chosen engine type.

Both engines take the upstream flag names (`davit serve` mirrors `vllm serve`); they differ in
how the runner is chosen (the release's `runnerSwitch` in the catalog: a `--runner` flag, an
environment variable, or none) and in their readiness endpoint. Spellings that change between
releases come from the release's catalog `arguments`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from davit_operator.api.spec import InferenceServiceSpec
from davit_operator.catalog.loader import EngineInfo, Release
from davit_operator.planning.errors import PlanError
from davit_operator.planning.offload import offload_args
from davit_operator.planning.runner import SelectedRunner

ENGINE_PORT = 8000
MODEL_CACHE_DIR = "/var/cache/davit"
MODELS_DIR = "/models"
# The model cache claim, mounted read-only (hf/ is a hub cache, s3/ plain directories).
MODEL_STORE_DIR = f"{MODEL_CACHE_DIR}/models"


@dataclass(frozen=True)
class ModelMount:
    """A volume the engine container needs for its model (a PVC, read-only)."""

    volume_name: str
    claim_name: str
    mount_path: str


@dataclass(frozen=True)
class EngineInvocation:
    command: list[str]
    args: list[str]
    env: list[dict[str, Any]]
    model_mounts: list[ModelMount] = field(default_factory=list)


def served_name(spec: InferenceServiceSpec) -> str:
    """model.servedName, else what follows hf:// or random://, else the file or the last path
    element of a pvc:// source."""
    if spec.model.served_name:
        return spec.model.served_name
    scheme, _, rest = spec.model.source.partition("://")
    if scheme == "pvc":
        last = (spec.model.file or rest).rstrip("/").rsplit("/", 1)[-1]
        return last.removesuffix(".gguf")
    return rest


def _model_location(spec: InferenceServiceSpec) -> tuple[str, list[str], list[ModelMount]]:
    scheme, _, rest = spec.model.source.partition("://")
    if scheme == "random" and spec.engine.type == "davit":
        # The Davit engine builds random weights from its own named shapes.
        return f"random:{rest}", [], []
    if scheme == "pvc":
        claim, _, path = rest.partition("/")
        mount = ModelMount(
            volume_name="model", claim_name=claim, mount_path=f"{MODELS_DIR}/{claim}"
        )
        location = f"{mount.mount_path}/{path}"
        if spec.model.file:
            location = f"{location}/{spec.model.file}"
        return location, [], [mount]
    if scheme == "s3":
        # The fetch Job's directory for this revision in the model cache (davit_operator.fetch).
        return f"{MODEL_STORE_DIR}/s3/{rest}/{spec.model.revision}", [], []
    flags: list[str] = []
    if spec.model.revision:
        flags += ["--revision", spec.model.revision]
    if scheme == "random":
        if "/" not in rest:
            raise PlanError(
                field="model.source",
                value=spec.model.source,
                reason="UnsupportedSource",
                condition="",
                message=f"model.source {spec.model.source}: {spec.engine.type} takes random "
                "weights in the shape of a Hugging Face repository; use random://ORG/NAME",
            )
        # The repository only supplies the config (shape); weights are random.
        flags += ["--load-format", "dummy"]
    return rest, flags, []


def _draft_location(
    spec: InferenceServiceSpec, draft: str, model_mounts: list[ModelMount]
) -> tuple[str, list[ModelMount]]:
    """Where the engine finds the draft model, loaded like model.source: an ORG/NAME or hf://
    repository from the Hugging Face cache, a pvc:// claim mounted read-only (the model's own
    mount when it is the same claim), random weights of a shape (davit)."""
    scheme, sep, rest = draft.partition("://")
    if not sep:
        return draft, []
    if scheme == "pvc":
        claim, _, path = rest.partition("/")
        shared = next((m for m in model_mounts if m.claim_name == claim), None)
        if shared is not None:
            return f"{shared.mount_path}/{path}", []
        mount = ModelMount(
            volume_name="draft-model", claim_name=claim, mount_path=f"{MODELS_DIR}/draft-{claim}"
        )
        return f"{mount.mount_path}/{path}", [mount]
    if scheme == "random" and spec.engine.type == "davit":
        return f"random:{rest}", []
    return rest, []


def _speculative_config(
    spec: InferenceServiceSpec, model_mounts: list[ModelMount]
) -> tuple[str | None, list[ModelMount]]:
    speculative = spec.features.speculative
    if speculative is None:
        return None, []
    config: dict[str, Any] = {
        "method": speculative.method,
        "num_speculative_tokens": speculative.num_speculative_tokens,
    }
    mounts: list[ModelMount] = []
    if speculative.draft_model:
        config["model"], mounts = _draft_location(spec, speculative.draft_model, model_mounts)
    if speculative.prompt_lookup_max is not None:
        config["prompt_lookup_max"] = speculative.prompt_lookup_max
    if speculative.prompt_lookup_min is not None:
        config["prompt_lookup_min"] = speculative.prompt_lookup_min
    if speculative.verification == "FLy":
        # Upstream's names: the lossy policy is visible in the effective engine arguments.
        config["rejection_sample_method"] = "fly"
        fly = speculative.fly
        if fly is not None and fly.window_size is not None:
            config["fly_window_size"] = fly.window_size
        if fly is not None and fly.entropy_threshold is not None:
            config["fly_entropy_threshold"] = fly.entropy_threshold
        if fly is not None and fly.entropy_top_k is not None:
            config["fly_entropy_top_k"] = fly.entropy_top_k
    return json.dumps(config, sort_keys=True, separators=(",", ":")), mounts


def _sequence_parallelism(spec: InferenceServiceSpec, release: Release) -> str:
    """The --compilation-config value that turns sequence parallelism on in `release`."""
    spelling = release.arguments.sequence_parallelism
    if spelling is None:
        # Capabilities refuse this first (the catalog requires it); a plain refusal here too.
        raise PlanError(
            field="parallelism.sequenceParallelism",
            value=True,
            reason="UnsupportedByEngine",
            condition="",
            message=f"{spec.engine.type} {release.version} has no sequence-parallelism setting; "
            "remove parallelism.sequenceParallelism",
        )
    config = {"pass_config": {spelling.pass_config_key: True}}
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


def engine_invocation(
    spec: InferenceServiceSpec, engine: EngineInfo, release: Release, runner: SelectedRunner
) -> EngineInvocation:
    """The container's command, args and env (deterministic order) for `spec` on `release` (the
    catalog release whose facts apply) with `runner`."""
    location, model_flags, mounts = _model_location(spec)
    args: list[str] = [location, "--served-model-name", served_name(spec)]
    args += ["--host", "0.0.0.0", "--port", str(ENGINE_PORT)]
    args += model_flags
    p = spec.parallelism
    if p.tensor > 1:
        args += ["--tensor-parallel-size", str(p.tensor)]
    if p.pipeline > 1:
        args += ["--pipeline-parallel-size", str(p.pipeline)]
    if p.data > 1:
        args += ["--data-parallel-size", str(p.data)]
    if p.expert.enabled:
        args.append("--enable-expert-parallel")
    if p.expert.elastic:
        args.append("--enable-elastic-ep")
    if p.dual_batch_overlap:
        args.append("--enable-dbo")
    if p.sequence_parallelism:
        args += ["--compilation-config", _sequence_parallelism(spec, release)]
    limits = spec.limits
    if limits.max_model_len is not None:
        args += ["--max-model-len", str(limits.max_model_len)]
    if limits.max_num_seqs is not None:
        args += ["--max-num-seqs", str(limits.max_num_seqs)]
    if limits.max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(limits.max_num_batched_tokens)]
    if limits.gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", repr(limits.gpu_memory_utilization)]
    args.append(
        "--enable-prefix-caching" if spec.features.prefix_caching else "--no-enable-prefix-caching"
    )
    args += offload_args(spec, engine)
    # Both engine types take upstream's FP8 flags; planning checked the release and accelerator.
    if spec.engine.quantization is not None:
        args += ["--quantization", spec.engine.quantization]
    if spec.engine.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", spec.engine.kv_cache_dtype]
    # The Davit engine's own flag; planning refused it for releases that lack it.
    if spec.engine.lm_head_quantization is not None:
        args += ["--lm-head-quantization", spec.engine.lm_head_quantization]
    speculative, draft_mounts = _speculative_config(spec, mounts)
    if speculative is not None:
        args += ["--speculative-config", speculative]
    mounts = mounts + draft_mounts
    if spec.features.custom_logits_processors:
        args += ["--logits-processors", *spec.features.custom_logits_processors]
    if spec.engine.type == "davit":
        # The pods' termination grace period is sized from the same number (builders).
        args += ["--drain-timeout", str(spec.rollout.drain_seconds)]

    env: list[dict[str, Any]] = [{"name": "HF_HOME", "value": f"{MODEL_CACHE_DIR}/huggingface"}]
    switch = release.runner_switch
    if switch is not None and switch.kind == "flag":
        args += [switch.name, runner.name]
    elif switch is not None and spec.engine.runner != "auto":
        # Only a forced runner: with auto the release decides itself (and a set variable would
        # change its decisions, e.g. what it refuses with dual-batch overlap).
        env.append({"name": switch.name, "value": switch.values[runner.name]})
    args += list(spec.engine.extra_args)

    # User variables override the operator's by name; server-side apply refuses duplicate keys.
    by_name: dict[str, dict[str, Any]] = {entry["name"]: entry for entry in env}
    for user in spec.pod.env:
        by_name[user.name] = user.model_dump(by_alias=True, exclude_none=True)
    return EngineInvocation(
        command=list(engine.command), args=args, env=list(by_name.values()), model_mounts=mounts
    )
