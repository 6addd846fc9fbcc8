"""The `InferenceService` spec: the only schema source for the CRD's `spec`.

Field descriptions become `kubectl explain` text; `Field` bounds, patterns and `Literal` enums
become OpenAPI validation; `x-kubernetes-validations` (CEL) rules carry the cross-field rules, so
the API server itself rejects invalid objects before the operator sees them. The operator parses
the same models again (`InferenceServiceSpec.model_validate`) and relies on the same defaults.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from kubernetes.utils.quantity import parse_quantity
from pydantic import ConfigDict, Field, field_validator, model_validator

from davit_operator.api.autoscaling import AutoscalingSpec
from davit_operator.api.rollout import RolloutSpec
from davit_operator.api.routing import RoutingSpec
from davit_operator.api.schema import CrdModel, Quantity, cel_rule, object_default

EngineType = Literal["davit", "vllm"]
Variant = Literal["cuda13.0", "cuda12.9", "rocm", "cpu", "xpu"]
RunnerChoice = Literal["auto", "v2", "v1"]
Vendor = Literal["nvidia", "amd", "intel", "cpu"]
ImagePolicy = Literal["Strict", "Permissive"]
# FP8 (e4m3): upstream's flag values, which both engine types take.
Quantization = Literal["fp8"]
# --lm-head-quantization (a Davit engine flag): fp8 (e4m3, needs FP8) or int8 (any accelerator);
# both per-row float32 scales, one byte per weight.
LmHeadQuantization = Literal["fp8", "int8"]
KvCacheDType = Literal["auto", "fp8"]
SpeculativeMethod = Literal[
    "ngram", "eagle", "eagle3", "mtp", "draft_model", "medusa", "mlp_speculator"
]
SpeculativeVerification = Literal["Strict", "FLy"]

# Flags the operator derives from typed fields; setting them through extraArgs would fight the plan.
OWNED_FLAGS = (
    "--port",
    "--host",
    "--served-model-name",
    "--tensor-parallel-size",
    "--pipeline-parallel-size",
    "--data-parallel-size",
    "--max-model-len",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--gpu-memory-utilization",
    "--kv-cache-memory-bytes",
    "--kv-offloading-size",
    "--kv-offloading-backend",
    "--kv-offload-disk-path",
    "--kv-offload-disk-bytes",
    "--runner",
    "--revision",
    "--speculative-config",
    "--logits-processors",
    "--quantization",
    "-q",
    "--kv-cache-dtype",
    "--lm-head-quantization",
)


# Device-plugin resources the operator requests from accelerator.vendor/count.
ACCELERATOR_RESOURCES = ("nvidia.com/gpu", "amd.com/gpu", "gpu.intel.com/i915")


class ModelShapeSpec(CrdModel):
    """The architecture numbers of config.json that the pre-flight memory check needs."""

    num_layers: int = Field(ge=1, le=1024, description="num_hidden_layers.")
    hidden_size: int = Field(ge=1, le=1_048_576, description="hidden_size.")
    intermediate_size: int = Field(ge=1, le=4_194_304, description="intermediate_size.")
    num_heads: int = Field(ge=1, le=4096, description="num_attention_heads.")
    num_kv_heads: int = Field(ge=1, le=4096, description="num_key_value_heads.")
    head_dim: int = Field(ge=1, le=4096, description="head_dim.")
    vocab_size: int = Field(ge=1, le=16_777_216, description="vocab_size.")
    max_position_embeddings: int = Field(
        ge=1, le=10_485_760, description="max_position_embeddings."
    )
    tie_word_embeddings: bool = Field(default=False, description="tie_word_embeddings.")


class ModelCacheSpec(CrdModel):
    """The model cache: a ReadWriteMany PersistentVolumeClaim every replica mounts read-only."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel_rule(
                    "!(has(self.claimName) && self.emptyDir)",
                    "model.cache.claimName and model.cache.emptyDir exclude each other",
                    ".emptyDir",
                )
            ]
        }
    )

    claim_name: str | None = Field(
        default=None,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description=(
            "A ReadWriteMany PersistentVolumeClaim in this namespace: the operator fetches each "
            "(source, revision) into it once with a fetch Job, shared by every service and "
            "replica that needs it; replicas mount it read-only and run offline."
        ),
    )
    empty_dir: bool = Field(
        default=False,
        description=(
            "Opt out of the cache: each pod gets an empty directory as its Hugging Face home "
            "and must find or fetch the model itself (vLLM downloads hf:// models on every "
            "start; the Davit engine never downloads, and s3:// needs the cache)."
        ),
    )


class ModelSpec(CrdModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel_rule(
                    "!self.source.startsWith('hf://') || has(self.revision)",
                    "model.revision is required for hf:// sources: pin the exact commit hash or "
                    "tag so that every replica loads the same weights",
                    ".revision",
                    reason="FieldValueRequired",
                ),
                cel_rule(
                    "!self.source.startsWith('s3://') || has(self.revision)",
                    "model.revision is required for s3:// sources: name the version of the "
                    "objects (a label you choose; a new label fetches the objects again)",
                    ".revision",
                    reason="FieldValueRequired",
                ),
                cel_rule(
                    "!has(self.endpoint) || self.source.startsWith('hf://') || "
                    "self.source.startsWith('s3://')",
                    "model.endpoint applies to hf:// and s3:// sources only",
                    ".endpoint",
                ),
                cel_rule(
                    "!has(self.credentialsSecret) || self.source.startsWith('hf://') || "
                    "self.source.startsWith('s3://')",
                    "model.credentialsSecret applies to hf:// and s3:// sources only",
                    ".credentialsSecret",
                ),
                cel_rule(
                    "!has(self.file) || self.file.endsWith('.gguf')",
                    "model.file names a single GGUF file inside the source and must end in .gguf; "
                    "omit it for safetensors directories",
                    ".file",
                ),
                cel_rule(
                    "!has(self.file) || self.source.startsWith('pvc://')",
                    "model.file names a file on a volume and needs a pvc:// source; hf:// and "
                    "random:// sources are loaded as repositories",
                    ".file",
                ),
            ]
        }
    )

    source: str = Field(
        max_length=512,
        pattern=r"^(hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*"
        r"|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/[A-Za-z0-9._-]+)+"
        r"|s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[A-Za-z0-9._-]+)+"
        r"|random://[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?)$",
        description=(
            "Where the weights come from: hf://ORG/NAME (a Hugging Face repository) or "
            "s3://BUCKET/PREFIX (an S3-compatible object store), fetched once per revision "
            "into the model cache (model.cache); pvc://CLAIM/PATH (a directory or file on a "
            "PersistentVolumeClaim in the same "
            "namespace, mounted read-only), or random://SHAPE (random weights of a shape the "
            "engine knows, davit only) or random://ORG/NAME (random weights in the shape of that "
            "repository's config), for benchmarks."
        ),
    )
    revision: str | None = Field(
        default=None,
        max_length=128,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$",
        description=(
            "Exact revision of an hf:// source (commit hash, tag or branch, resolved to a "
            "commit once when fetched), or the version label of an s3:// source. Required for "
            "both, so that every replica and every restart loads the same weights; a change "
            "fetches the new revision before any replica switches to it."
        ),
    )
    endpoint: str | None = Field(
        default=None,
        max_length=512,
        pattern=r"^https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?(/[A-Za-z0-9._~/-]*)?$",
        description=(
            "Base URL of the hub (hf://; default: the operator's --hf-endpoint, else the "
            "public hub) or of the S3-compatible endpoint (s3://; default: the operator's "
            "--s3-endpoint)."
        ),
    )
    credentials_secret: str | None = Field(
        default=None,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description=(
            "A Secret in this namespace holding the source's credentials: key HF_TOKEN for "
            "hf:// (gated or private repositories); AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY (optionally AWS_SESSION_TOKEN) for s3://. Only the fetch "
            "Job gets them, by reference; they never appear in status, events or engine "
            "arguments."
        ),
    )
    cache: ModelCacheSpec = Field(
        default_factory=lambda: ModelCacheSpec(),
        json_schema_extra={"default": {}},
        description=(
            "Where hf:// and s3:// models are fetched to. Default: the claim named by the "
            "operator's --model-cache."
        ),
    )
    file: str | None = Field(
        default=None,
        max_length=256,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$",
        description="A GGUF file inside the source to load instead of a safetensors directory.",
    )
    served_name: str | None = Field(
        default=None,
        max_length=128,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._/:-]*$",
        description=(
            "Model name clients send in OpenAI requests. Defaults to ORG/NAME of the source "
            "(the last path element for pvc://)."
        ),
    )
    shape: ModelShapeSpec | None = Field(
        default=None,
        description=(
            "The model's architecture for the pre-flight memory check, when the operator's "
            "catalog of known shapes does not have it."
        ),
    )


class SecretKeySelector(CrdModel):
    """One key of a Secret in the InferenceService's namespace."""

    name: str = Field(
        min_length=1,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="The Secret's name.",
    )
    key: str = Field(
        min_length=1,
        max_length=253,
        pattern=r"^[-._a-zA-Z0-9]+$",
        description="The key within the Secret whose value is used.",
    )


class EngineSpec(CrdModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel_rule(
                    "self.imagePolicy != 'Strict' || !has(self.image) || "
                    "self.image.contains('@sha256:')",
                    "engine.imagePolicy Strict requires engine.image to be pinned by digest "
                    "(REPOSITORY@sha256:...); use imagePolicy: Permissive to allow a tag",
                    ".image",
                ),
                cel_rule(
                    "!has(self.extraArgs) || self.extraArgs.all(a, !(a.split('=')[0] in ["
                    + ", ".join(f"'{flag}'" for flag in OWNED_FLAGS)
                    + "]))",
                    "engine.extraArgs must not set flags the operator derives from typed fields "
                    "(" + ", ".join(OWNED_FLAGS) + "); set the matching spec field instead",
                    ".extraArgs",
                ),
            ]
        }
    )

    type: EngineType = Field(
        default="davit",
        description="Which engine serves the model: davit (this project's engine) or vllm "
        "(upstream vLLM images).",
    )
    version: str = Field(
        max_length=32,
        pattern=r"^[0-9]+\.[0-9]+\.[0-9]+$",
        description=(
            "Engine release (MAJOR.MINOR.PATCH) looked up in the operator's catalog, which maps "
            "it to the exact image tag even where a release title differs from its tag."
        ),
    )
    variant: Variant | None = Field(
        default=None,
        description=(
            "Image variant. Defaults from accelerator.vendor: nvidia -> cuda13.0, amd -> rocm, "
            "intel -> xpu, cpu -> cpu. cuda12.9 is only published by some releases."
        ),
    )
    image: str | None = Field(
        default=None,
        max_length=512,
        pattern=r"^[a-z0-9]([a-z0-9._/:-]*[a-z0-9])?(:[A-Za-z0-9_][A-Za-z0-9._-]{0,127})?"
        r"(@sha256:[a-f0-9]{64})?$",
        description=(
            "Image override (REPOSITORY:TAG or REPOSITORY@sha256:DIGEST). The engine type and "
            "version still select arguments and runner; the catalog's image is not used."
        ),
    )
    image_policy: ImagePolicy = Field(
        default="Permissive",
        description=(
            "Strict: refuse any image not pinned by digest (catalog digest or an override with "
            "@sha256:). Permissive: a tag is accepted and reported as unpinned in status."
        ),
    )
    runner: RunnerChoice = Field(
        default="auto",
        description=(
            "Model runner: auto picks V2 unless a requested feature needs V1 (the reason is "
            "reported in status); v2 or v1 force one and are refused when unsupported."
        ),
    )
    quantization: Quantization | None = Field(
        default=None,
        description=(
            "Projection weights in FP8 (e4m3), passed as --quantization fp8: checkpoints in "
            "bf16/fp16 are quantized when the engine loads them (per-channel weight scales), "
            "FP8 checkpoints are served in FP8 (a Davit engine re-quantizes block-wise scales "
            "to per-channel ones at load). About half the weight bytes per GPU. Needs "
            "an accelerator the catalog records with FP8 and an engine release that "
            "implements it; unset: the checkpoint's own format."
        ),
    )
    lm_head_quantization: LmHeadQuantization | None = Field(
        default=None,
        description=(
            "The LM head's weight at one byte per weight with a float32 scale per row "
            "(vocabulary entry), passed as --lm-head-quantization VALUE. fp8: e4m3; needs an "
            "accelerator the catalog records with FP8. int8: weight-only, scale = row absmax / "
            "127; about four times more accurate than fp8 at the same bytes; any accelerator. "
            "Both are lossy beyond engine.quantization (which keeps the LM head in the model "
            "dtype). A Davit engine flag (no upstream equivalent): releases implement it only "
            "where the catalog says so; unset: the LM head in the model dtype."
        ),
    )
    kv_cache_dtype: KvCacheDType = Field(
        default="auto",
        description=(
            "KV-cache element type, passed as --kv-cache-dtype: auto (the model dtype) or fp8 "
            "(e4m3 with per-layer scales: one byte per element, about twice the tokens per "
            "GPU). fp8 needs an accelerator the catalog records with FP8 and an engine release "
            "that implements it."
        ),
    )
    extra_args: list[Annotated[str, Field(max_length=256)]] = Field(
        default_factory=list,
        max_length=64,
        description="Additional engine command-line arguments, appended after the derived ones.",
    )
    api_key_secret_ref: SecretKeySelector | None = Field(
        default=None,
        description=(
            "A Secret key holding the API key the engine requires on its API routes "
            "(Authorization: Bearer KEY; /health, /ready and /metrics stay open). Passed as the "
            "VLLM_API_KEY environment variable from the Secret, never in arguments or status."
        ),
    )


class AcceleratorSpec(CrdModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel_rule(
                    "self.vendor != 'cpu' || !has(self.count) || self.count == 0",
                    "accelerator.count must be 0 or unset when accelerator.vendor is cpu",
                    ".count",
                ),
                cel_rule(
                    "self.vendor == 'cpu' || !has(self.count) || self.count >= 1",
                    "accelerator.count must be at least 1 for a GPU vendor; use vendor: cpu to "
                    "run without accelerators",
                    ".count",
                ),
                cel_rule(
                    "self.vendor != 'cpu' || !has(self.product)",
                    "accelerator.product names a GPU model and cannot be set for vendor cpu",
                    ".product",
                ),
            ]
        }
    )

    vendor: Vendor = Field(
        description="Accelerator vendor; selects the device resource and image variant."
    )
    product: str | None = Field(
        default=None,
        max_length=63,
        pattern=r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$",
        description=(
            "GPU product as the node's product label spells it (for example NVIDIA-H200, "
            "AMD-Instinct-MI300X); pods are placed only on nodes with that label value."
        ),
    )
    count: int | None = Field(
        default=None,
        ge=0,
        le=64,
        description=(
            "Accelerators per replica. Defaults to parallelism.tensor x pipeline x data for GPU "
            "vendors; must equal that product when set."
        ),
    )


class ExpertParallelSpec(CrdModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel_rule(
                    "!self.elastic || self.enabled",
                    "parallelism.expert.elastic requires parallelism.expert.enabled: true",
                    ".elastic",
                )
            ]
        }
    )

    enabled: bool = Field(default=False, description="Shard MoE experts across the GPUs.")
    elastic: bool = Field(
        default=False,
        description="Elastic expert parallelism (rescale without restart); the runner that serves "
        "it depends on the engine release (status says which).",
    )


class ParallelismSpec(CrdModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel_rule(
                    "!self.sequenceParallelism || self.tensor >= 2",
                    "parallelism.sequenceParallelism shards along the tensor-parallel group; set "
                    "parallelism.tensor to 2 or more",
                    ".sequenceParallelism",
                ),
                cel_rule(
                    "!self.dualBatchOverlap || self.expert.enabled",
                    "parallelism.dualBatchOverlap overlaps expert-parallel communication; set "
                    "parallelism.expert.enabled: true",
                    ".dualBatchOverlap",
                ),
            ]
        }
    )

    tensor: int = Field(default=1, ge=1, le=64, description="Tensor-parallel size inside a pod.")
    pipeline: int = Field(
        default=1, ge=1, le=16, description="Pipeline-parallel size inside a pod."
    )
    data: int = Field(default=1, ge=1, le=64, description="Data-parallel ranks inside a pod.")
    sequence_parallelism: bool = Field(
        default=False, description="Sequence parallelism across the tensor-parallel group."
    )
    dual_batch_overlap: bool = Field(
        default=False, description="Dual-batch overlap of compute and expert communication."
    )
    expert: ExpertParallelSpec = Field(
        default_factory=ExpertParallelSpec,
        json_schema_extra={"default": object_default(ExpertParallelSpec)},
        description="Expert parallelism for mixture-of-experts models.",
    )


class FLySpec(CrdModel):
    """Upstream's FLy parameters (`fly_window_size`, `fly_entropy_threshold`,
    `fly_entropy_top_k`); unset ones take the engine's defaults."""

    window_size: int | None = Field(
        default=None,
        ge=1,
        le=15,
        description=(
            "Drafts after a rejected one that must all be accepted for FLy to keep it; at most "
            "numSpeculativeTokens - 1 (engine default min(6, numSpeculativeTokens - 1))."
        ),
    )
    entropy_threshold: float | None = Field(
        default=None,
        ge=0.0,
        le=20.0,
        description="Top-k entropy (nats) above which a rejection may be kept (default 0.3).",
    )
    entropy_top_k: int | None = Field(
        default=None, ge=2, le=64, description="Tokens in that entropy (default 3)."
    )


# What a draft model may be: an ORG/NAME repository (as upstream's `model`), or a source like
# model.source (hf://, pvc://, random://), loaded the same way.
DRAFT_MODEL_PATTERN = (
    r"^([A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*"
    r"|hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*"
    r"|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/[A-Za-z0-9._-]+)+"
    r"|random://[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?)$"
)


class SpeculativeSpec(CrdModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel_rule(
                    "self.method != 'draft_model' || has(self.draftModel)",
                    "features.speculative.draftModel is required when method is draft_model",
                    ".draftModel",
                    reason="FieldValueRequired",
                ),
                cel_rule(
                    "self.method == 'draft_model' || !has(self.draftModel)",
                    "features.speculative.draftModel is only used by method draft_model",
                    ".draftModel",
                ),
                cel_rule(
                    "self.method == 'ngram' || (!has(self.promptLookupMax) && "
                    "!has(self.promptLookupMin))",
                    "promptLookupMin/promptLookupMax only apply to method ngram",
                ),
                cel_rule(
                    "!has(self.promptLookupMax) || !has(self.promptLookupMin) || "
                    "self.promptLookupMin <= self.promptLookupMax",
                    "features.speculative.promptLookupMin must not exceed promptLookupMax",
                    ".promptLookupMin",
                ),
                cel_rule(
                    "self.verification != 'FLy' || self.numSpeculativeTokens >= 2",
                    "features.speculative.verification FLy needs numSpeculativeTokens >= 2 (a "
                    "rejected draft is kept only when later drafts confirm it)",
                    ".numSpeculativeTokens",
                ),
                cel_rule(
                    "!has(self.fly) || self.verification == 'FLy'",
                    "features.speculative.fly only applies to verification FLy",
                    ".fly",
                ),
                cel_rule(
                    "!has(self.fly) || !has(self.fly.windowSize) || "
                    "self.fly.windowSize < self.numSpeculativeTokens",
                    "features.speculative.fly.windowSize must be below numSpeculativeTokens",
                    ".fly.windowSize",
                ),
            ]
        }
    )

    method: SpeculativeMethod = Field(description="Speculative decoding proposer.")
    num_speculative_tokens: int = Field(
        default=4, ge=1, le=16, description="Draft tokens proposed per step."
    )
    draft_model: str | None = Field(
        default=None,
        max_length=512,
        pattern=DRAFT_MODEL_PATTERN,
        description=(
            "The draft model (method draft_model only): ORG/NAME or hf://ORG/NAME (a Hugging "
            "Face repository), pvc://CLAIM/PATH (mounted read-only like model.source) or "
            "random://SHAPE; it must share the model's tokenizer."
        ),
    )
    prompt_lookup_max: int | None = Field(
        default=None, ge=1, le=64, description="Longest n-gram matched in the prompt (ngram)."
    )
    prompt_lookup_min: int | None = Field(
        default=None, ge=1, le=64, description="Shortest n-gram matched in the prompt (ngram)."
    )
    verification: SpeculativeVerification = Field(
        default="Strict",
        description=(
            "How drafts are verified. Strict (default): lossless, the output follows the "
            "model's own distribution. FLy: lossy, may keep a rejected draft in a "
            "high-entropy position when the next drafts confirm it (faster, possibly lower "
            "quality); reported in status."
        ),
    )
    fly: FLySpec | None = Field(
        default=None, description="FLy's parameters (verification FLy only)."
    )


def _positive_size_rule(field: str) -> dict[str, Any]:
    return cel_rule(
        "type(self.size) == int ? self.size > 0 : "
        "(isQuantity(self.size) && quantity(self.size).isGreaterThan(quantity('0')))",
        f"{field}.size must be a positive quantity (bytes, or with a suffix such as Gi)",
        ".size",
    )


def positive_bytes(value: int | str, field: str) -> int:
    """A quantity as whole bytes; ValueError naming `field` unless it is positive."""
    try:
        amount = parse_quantity(value)
    except ValueError:
        raise ValueError(f"{field} must be a quantity such as 32Gi, got {value!r}") from None
    if amount <= 0:
        raise ValueError(f"{field} must be positive, got {value!r}")
    return int(amount)


class KvOffloadCpuSpec(CrdModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [_positive_size_rule("features.kvCacheOffloading.cpu")]
        }
    )

    size: Quantity = Field(
        description=(
            "Host memory for KV blocks (e.g. 32Gi), passed as --kv-offloading-size (GiB, "
            "upstream's flag); the pod's memory request (and limit, if set) grows by it."
        )
    )

    @field_validator("size")
    @classmethod
    def _positive(cls, value: int | str) -> int | str:
        positive_bytes(value, "features.kvCacheOffloading.cpu.size")
        return value


class KvOffloadDiskSpec(CrdModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _positive_size_rule("features.kvCacheOffloading.disk"),
                cel_rule(
                    "self.kind != 'PersistentVolumeClaim' || has(self.claimName)",
                    "features.kvCacheOffloading.disk.claimName is required when kind is "
                    "PersistentVolumeClaim",
                    ".claimName",
                    reason="FieldValueRequired",
                ),
                cel_rule(
                    "self.kind == 'PersistentVolumeClaim' || !has(self.claimName)",
                    "features.kvCacheOffloading.disk.claimName only applies to kind "
                    "PersistentVolumeClaim",
                    ".claimName",
                ),
            ]
        }
    )

    size: Quantity = Field(
        description=(
            "Bytes of KV block files (e.g. 200Gi): the emptyDir's sizeLimit; the engine keeps "
            "its files within 90% of it (--kv-offload-disk-bytes)."
        )
    )
    kind: Literal["EmptyDir", "PersistentVolumeClaim"] = Field(
        default="EmptyDir",
        description=(
            "EmptyDir: a per-pod folder, gone with the pod. PersistentVolumeClaim: the claim "
            "claimName, so a restarted pod finds its prefixes (give each replica its own claim, "
            "or a ReadWriteMany one: replicas then share the files)."
        ),
    )
    claim_name: str | None = Field(
        default=None,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="The PersistentVolumeClaim (kind PersistentVolumeClaim only).",
    )

    @field_validator("size")
    @classmethod
    def _positive(cls, value: int | str) -> int | str:
        positive_bytes(value, "features.kvCacheOffloading.disk.size")
        return value

    @model_validator(mode="after")
    def _claim(self) -> KvOffloadDiskSpec:
        if (self.kind == "PersistentVolumeClaim") != (self.claim_name is not None):
            raise ValueError(
                "features.kvCacheOffloading.disk.claimName is required with kind "
                "PersistentVolumeClaim and only allowed with it"
            )
        return self


class KvCacheOffloadingSpec(CrdModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel_rule(
                    "has(self.cpu) || has(self.disk)",
                    "features.kvCacheOffloading needs cpu, disk or both",
                )
            ]
        }
    )

    cpu: KvOffloadCpuSpec | None = Field(
        default=None, description="The CPU tier: host memory below the GPU prefix cache."
    )
    disk: KvOffloadDiskSpec | None = Field(
        default=None, description="The disk tier: block files below the CPU tier."
    )

    @model_validator(mode="after")
    def _some_tier(self) -> KvCacheOffloadingSpec:
        if self.cpu is None and self.disk is None:
            raise ValueError("features.kvCacheOffloading needs cpu, disk or both")
        return self


class FeaturesSpec(CrdModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel_rule(
                    "!has(self.kvCacheOffloading) || self.prefixCaching",
                    "features.kvCacheOffloading stores prefix-cache blocks: it needs "
                    "features.prefixCaching true",
                    ".kvCacheOffloading",
                )
            ]
        }
    )

    prefix_caching: bool = Field(
        default=True, description="Reuse KV-cache blocks of shared prompt prefixes."
    )
    speculative: SpeculativeSpec | None = Field(
        default=None, description="Speculative decoding; off when unset."
    )
    kv_cache_offloading: KvCacheOffloadingSpec | None = Field(
        default=None,
        description=(
            "KV-cache tiers below the GPU prefix cache (host memory, then disk): a prompt whose "
            "prefix left the GPU loads it back instead of recomputing it. Needs prefixCaching."
        ),
    )
    custom_logits_processors: list[
        Annotated[
            str,
            Field(
                max_length=256,
                pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
                r"(:[A-Za-z_][A-Za-z0-9_]*)?$",
            ),
        ]
    ] = Field(
        default_factory=list,
        max_length=16,
        description=(
            "Fully qualified names of custom logits processors loaded by the engine "
            "(module.Class). Runner V2 does not support them: they select V1."
        ),
    )

    @model_validator(mode="after")
    def _offload_needs_prefix_caching(self) -> FeaturesSpec:
        if self.kv_cache_offloading is not None and not self.prefix_caching:
            raise ValueError(
                "features.kvCacheOffloading stores prefix-cache blocks: it needs "
                "features.prefixCaching true"
            )
        return self


class LimitsSpec(CrdModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel_rule(
                    "!has(self.maxNumBatchedTokens) || !has(self.maxNumSeqs) || "
                    "self.maxNumBatchedTokens >= self.maxNumSeqs",
                    "limits.maxNumBatchedTokens must be at least limits.maxNumSeqs: every "
                    "running sequence needs one token per step",
                    ".maxNumBatchedTokens",
                ),
            ]
        }
    )

    max_model_len: int | None = Field(
        default=None, ge=16, le=10_485_760, description="Longest prompt + output, in tokens."
    )
    max_num_seqs: int | None = Field(
        default=None, ge=1, le=65_536, description="Most sequences scheduled in one step."
    )
    max_num_batched_tokens: int | None = Field(
        default=None, ge=1, le=10_485_760, description="Token budget of one scheduler step."
    )
    gpu_memory_utilization: float | None = Field(
        default=None,
        gt=0.0,
        le=1.0,
        description="Fraction of each GPU's memory the engine may use (0 < x <= 1).",
    )
    kv_cache_memory_bytes: int | None = Field(
        default=None,
        ge=1,
        description=(
            "KV-cache bytes per GPU, passed to every replica as --kv-cache-memory-bytes. "
            "Unset: the operator profiles the engine once per identity and passes the result."
        ),
    )


class Toleration(CrdModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel_rule(
                    "self.operator != 'Exists' || !has(self.value)",
                    "a toleration with operator Exists matches any value; remove value",
                    ".value",
                ),
                cel_rule(
                    "has(self.key) || self.operator == 'Exists'",
                    "a toleration without key must use operator Exists (it then tolerates every "
                    "taint)",
                    ".operator",
                ),
            ]
        }
    )

    key: str | None = Field(default=None, max_length=316, description="Taint key to tolerate.")
    operator: Literal["Exists", "Equal"] = Field(default="Equal", description="Exists or Equal.")
    value: str | None = Field(default=None, max_length=63, description="Taint value (Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to tolerate; all effects when unset."
    )
    toleration_seconds: int | None = Field(
        default=None, ge=0, description="How long a NoExecute taint is tolerated."
    )


class EnvVar(CrdModel):
    name: str = Field(
        max_length=256,
        pattern=r"^[A-Za-z_][A-Za-z0-9_.-]*$",
        description="Environment variable name.",
    )
    value: str | None = Field(default=None, max_length=32768, description="Literal value.")
    value_from: dict[str, Any] | None = Field(
        default=None,
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
        description="A core/v1 EnvVarSource (secretKeyRef, configMapKeyRef, fieldRef, ...).",
    )


class ResourcesSpec(CrdModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel_rule(
                    " && ".join(
                        f"(!has(self.{section}) || !('{r}' in self.{section}))"
                        for section in ("requests", "limits")
                        for r in ACCELERATOR_RESOURCES
                    ),
                    "pod.resources cannot request accelerators ("
                    + ", ".join(ACCELERATOR_RESOURCES)
                    + "); set accelerator.vendor and accelerator.count instead",
                )
            ]
        }
    )

    requests: dict[str, Quantity] = Field(
        default_factory=dict,
        max_length=32,
        description="Extra resource requests (cpu, memory, ...).",
    )
    limits: dict[str, Quantity] = Field(
        default_factory=dict, max_length=32, description="Extra resource limits (cpu, memory, ...)."
    )


class PodSpecOverrides(CrdModel):
    node_selector: dict[str, Annotated[str, Field(max_length=63)]] = Field(
        default_factory=dict, description="Node labels added to the accelerator's own selector."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=32, description="Tolerations for the engine pods."
    )
    resources: ResourcesSpec = Field(
        default_factory=ResourcesSpec,
        json_schema_extra={"default": object_default(ResourcesSpec)},
        description=(
            "CPU/memory requests and limits. The accelerator resource itself comes from "
            "accelerator.vendor and count and cannot be set here."
        ),
    )
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=64,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
        description="Extra environment variables for the engine container.",
    )
    service_account_name: str | None = Field(
        default=None,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="ServiceAccount of the engine pods.",
    )


class InferenceServiceSpec(CrdModel):
    """Desired state of one served model."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel_rule(
                    "!has(self.accelerator.count) || self.accelerator.vendor == 'cpu' || "
                    "self.accelerator.count == "
                    "self.parallelism.tensor * self.parallelism.pipeline * self.parallelism.data",
                    "accelerator.count must equal parallelism.tensor x pipeline x data (the GPUs one "
                    "replica uses); omit accelerator.count to derive it",
                    ".accelerator.count",
                ),
                cel_rule(
                    "self.accelerator.vendor != 'cpu' || !has(self.limits.gpuMemoryUtilization)",
                    "limits.gpuMemoryUtilization applies to GPU memory; remove it for "
                    "accelerator.vendor cpu",
                    ".limits.gpuMemoryUtilization",
                ),
                cel_rule(
                    "self.accelerator.vendor != 'cpu' || (self.parallelism.tensor == 1 && "
                    "self.parallelism.pipeline == 1)",
                    "tensor and pipeline parallelism need GPUs; set accelerator.vendor to a GPU "
                    "vendor or parallelism.tensor/pipeline to 1",
                    ".parallelism",
                ),
                cel_rule(
                    "!has(self.engine.variant) || "
                    "(self.accelerator.vendor == 'nvidia' && self.engine.variant.startsWith('cuda'))"
                    " || (self.accelerator.vendor == 'amd' && self.engine.variant == 'rocm')"
                    " || (self.accelerator.vendor == 'intel' && self.engine.variant == 'xpu')"
                    " || (self.accelerator.vendor == 'cpu' && self.engine.variant == 'cpu')",
                    "engine.variant does not run on accelerator.vendor (nvidia: cuda13.0 or cuda12.9, "
                    "amd: rocm, intel: xpu, cpu: cpu); omit engine.variant to derive it",
                    ".engine.variant",
                ),
            ]
        }
    )

    model: ModelSpec = Field(description="The model to serve.")
    engine: EngineSpec = Field(description="Engine type, release, image and runner.")
    accelerator: AcceleratorSpec = Field(description="Accelerator per replica.")
    parallelism: ParallelismSpec = Field(
        default_factory=ParallelismSpec,
        json_schema_extra={"default": object_default(ParallelismSpec)},
        description="How one replica spreads over its accelerators.",
    )
    features: FeaturesSpec = Field(
        default_factory=FeaturesSpec,
        json_schema_extra={"default": object_default(FeaturesSpec)},
        description="Optional engine features; some of them select runner V1.",
    )
    limits: LimitsSpec = Field(
        default_factory=LimitsSpec,
        json_schema_extra={"default": object_default(LimitsSpec)},
        description="Memory and scheduling limits passed to the engine.",
    )
    replicas: int = Field(
        default=1,
        ge=0,
        le=1000,
        description="Engine pods (replicas), also set through the scale subresource (kubectl "
        "scale). With autoscaling, the starting point only: the autoscaler's writes through "
        "the scale subresource move the count, and a re-applied manifest does not reset it.",
    )
    autoscaling: AutoscalingSpec | None = Field(
        default=None,
        description="Scale with the engines' load: the operator owns a HorizontalPodAutoscaler "
        "(autoscaling/v2) on this service's scale subresource, fed Pods metrics from "
        "custom.metrics.k8s.io; off when unset.",
    )
    routing: RoutingSpec = Field(
        default_factory=RoutingSpec,
        json_schema_extra={"default": object_default(RoutingSpec)},
        description="Gateway API routing: an InferencePool (and HTTPRoute) in front of the "
        "engines.",
    )
    pod: PodSpecOverrides = Field(
        default_factory=PodSpecOverrides,
        json_schema_extra={"default": object_default(PodSpecOverrides)},
        description="Pod-level overrides: node selector, tolerations, resources, env, account.",
    )
    rollout: RolloutSpec = Field(
        default_factory=RolloutSpec,
        json_schema_extra={"default": object_default(RolloutSpec)},
        description="How spec changes reach the replicas: rolling or canary, metric gates, "
        "automatic rollback, pause, drain time.",
    )
