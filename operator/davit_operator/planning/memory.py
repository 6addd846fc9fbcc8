"""Memory planning: the pre-flight fit check, the profile identity and the memory plan.

Pure functions (no I/O). Three sources size the KV cache, in this order of preference:
- `explicit`: `limits.kvCacheMemoryBytes` in the spec, passed to every replica as is;
- `profile`: a measured engine profile (davit_contract.profile) stored for this identity, whose
  KV bytes every replica gets as `--kv-cache-memory-bytes`;
- `estimate`: arithmetic from the model's shape and the accelerator's memory; used for the
  pre-flight check and reported while no profile exists (engines then size themselves).

The profile identity is what the measured numbers depend on and the operator knows before any
pod runs: the image (digest when pinned), engine version, model source and revision, GPU product
and count, parallelism, limits, runner and extra engine arguments. Its hash labels the stored
profile; an unchanged identity reuses it, any change makes a new profiling Job.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from davit_contract import engine_defaults
from davit_contract.graphs import cuda_graph_estimate
from davit_contract.profile import MemoryProfile
from davit_operator.api.spec import InferenceServiceSpec
from davit_operator.api.status import MemoryPlanStatus
from davit_operator.planning.errors import PlanError
from davit_operator.planning.offload import tier_tokens

if TYPE_CHECKING:
    from davit_operator.planning.plan import Plan

MemorySource = Literal["explicit", "profile", "estimate", "pending"]

ACCELERATOR_DTYPE_BYTES = 2  # bf16 on accelerators
FP8_BYTES = 1
# Per-output-channel float32 scale of each FP8 projection.
FP8_SCALE_BYTES = 4
# engine.lmHeadQuantization values that store the LM head at one byte per weight with a float32
# scale per row (vocabulary entry): fp8 (e4m3) and int8.
ONE_BYTE_LM_HEADS: frozenset[str] = frozenset({"fp8", "int8"})
LM_HEAD_WEIGHT_BYTES = 1
LM_HEAD_ROW_SCALE_BYTES = 4
# Estimate of what the shape does not say: CUDA context and library workspaces (0.77 GiB
# measured on an H200 with torch 2.11).
NON_TORCH_ESTIMATE_BYTES = 1 << 30
KV_FLAG = "--kv-cache-memory-bytes"


class ShapeError(ValueError):
    """The shape catalog is malformed (names the file and the field)."""


class _Data(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


class ModelShape(_Data):
    """The architecture numbers that size weights, activations and the KV cache."""

    names: tuple[str, ...] = ()
    num_layers: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    intermediate_size: int = Field(ge=1)
    num_heads: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    vocab_size: int = Field(ge=1)
    max_position_embeddings: int = Field(ge=1)
    tie_word_embeddings: bool = False
    # The checkpoint stores its decoder projections in FP8 (config.json's quantization_config):
    # one byte each whether or not engine.quantization asks for it.
    fp8_projections: bool = False
    # A block-wise FP8 checkpoint's scale blocks are this many input columns wide
    # (weight_block_size, or compressed-tensors' block_structure); None: no block scales.
    fp8_block_columns: int | None = Field(default=None, ge=1)

    @property
    def num_parameters(self) -> int:
        h, d = self.hidden_size, self.head_dim
        attention = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2
        layer = attention + 3 * h * self.intermediate_size + 2 * h
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + embeddings + h

    @property
    def projection_parameters(self) -> int:
        """The decoder projections' weights (q, k, v, o, gate, up, down of every layer): what
        FP8 weights store in one byte each."""
        h, d = self.hidden_size, self.head_dim
        attention = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2
        return self.num_layers * (attention + 3 * h * self.intermediate_size)

    @property
    def projection_channels(self) -> int:
        """Output channels of the decoder projections (one FP8 weight scale each)."""
        h, d = self.hidden_size, self.head_dim
        per_layer = (
            (self.num_heads + 2 * self.num_kv_heads) * d + h + 2 * self.intermediate_size + h
        )
        return self.num_layers * per_layer

    def projection_scale_groups(self, columns: int) -> int:
        """Scales of the decoder projections held one per output row and group of `columns`
        input columns (a block-wise FP8 checkpoint served with its own scales:
        `--fp8-block-scales native`, one float32 each)."""
        h, d = self.hidden_size, self.head_dim
        reading_hidden = (self.num_heads + 2 * self.num_kv_heads) * d + 2 * self.intermediate_size
        per_layer = (
            reading_hidden * -(-h // columns)  # q/k/v, gate/up
            + h * -(-(self.num_heads * d) // columns)  # o
            + h * -(-self.intermediate_size // columns)  # down
        )
        return self.num_layers * per_layer


class ShapeCatalog(_Data):
    schema_version: Literal[1]
    shapes: dict[str, ModelShape]
    accelerator_memory_mi_b: dict[str, int] = Field(alias="acceleratorMemoryMiB")

    def find(self, key: str) -> ModelShape | None:
        """A shape by its name or by one of its repository ids (without case)."""
        wanted = key.lower()
        for name, shape in self.shapes.items():
            if wanted == name or wanted in (n.lower() for n in shape.names):
                return shape
        return None

    def device_bytes(self, product: str | None) -> int | None:
        if product is None or product not in self.accelerator_memory_mi_b:
            return None
        return self.accelerator_memory_mi_b[product] * 2**20


def load_shape_catalog(path: Path | None = None) -> ShapeCatalog:
    """Load `model_shapes.yaml` (default: the packaged one); ShapeError names what is wrong."""
    source: Path | resources.abc.Traversable = (
        path
        if path is not None
        else resources.files("davit_operator.catalog").joinpath("model_shapes.yaml")
    )
    try:
        return ShapeCatalog.model_validate(yaml.safe_load(source.read_text()))
    except (ValidationError, yaml.YAMLError) as exc:
        raise ShapeError(f"{source}: {exc}") from exc


def shape_for(spec: InferenceServiceSpec, catalog: ShapeCatalog) -> ModelShape | None:
    """model.shape when given, else the catalog's entry for the source; None when unknown."""
    explicit = getattr(spec.model, "shape", None)
    if explicit is not None:
        return ModelShape.model_validate(explicit.model_dump())
    scheme, _, rest = spec.model.source.partition("://")
    if scheme in ("hf", "random"):
        return catalog.find(rest)
    return None


def draft_shape_for(
    spec: InferenceServiceSpec, catalog: ShapeCatalog
) -> tuple[bool, ModelShape | None]:
    """(whether a draft model is configured, its shape when the catalog knows it)."""
    speculative = spec.features.speculative
    if speculative is None or speculative.method != "draft_model" or not speculative.draft_model:
        return False, None
    scheme, sep, rest = speculative.draft_model.partition("://")
    if not sep:
        return True, catalog.find(speculative.draft_model)
    if scheme in ("hf", "random"):
        return True, catalog.find(rest)
    return True, None


def shape_from_config(config: Any) -> ModelShape:
    """A shape from a checkpoint's config.json (Hugging Face field names). Raises ShapeError
    naming the missing or malformed field."""
    if not isinstance(config, dict):
        raise ShapeError("config.json is not a JSON object")
    if isinstance(config.get("text_config"), dict):
        config = {**config, **config["text_config"]}
    try:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return ModelShape(
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            vocab_size=int(config["vocab_size"]),
            max_position_embeddings=int(config["max_position_embeddings"]),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            fp8_projections=_fp8_checkpoint(config.get("quantization_config")),
            fp8_block_columns=_fp8_block_columns(config.get("quantization_config")),
        )
    except KeyError as exc:
        raise ShapeError(f"config.json has no {exc.args[0]}") from None
    except (TypeError, ValueError, ValidationError) as exc:
        raise ShapeError(f"config.json: {exc}") from None


# ModelOpt's `quant_algo` values whose weights are FP8 (per tensor, per channel, per block).
MODELOPT_FP8_ALGOS = frozenset({"FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO"})


def _fp8_checkpoint(quant: Any) -> bool:
    """Whether config.json's quantization_config stores the projections in FP8: `quant_method:
    fp8` (per tensor, channel or block) or `fbgemm_fp8` (per channel), compressed-tensors whose
    weights are 8-bit floats, or a ModelOpt export with an FP8 `quant_algo` (at the top or under
    `quantization`). Anything else (absent, other schemes) counts as the accelerator dtype: the
    engine decides whether it can serve it. (A ModelOpt export that keeps its settings in
    hf_quant_config.json: model_config.py passes that file as its quantization_config.)"""
    if not isinstance(quant, dict):
        return False
    method = quant.get("quant_method")
    if method in ("fp8", "fbgemm_fp8"):
        return True
    producer = quant.get("producer")
    if (isinstance(method, str) and method.lower() == "modelopt") or (
        isinstance(producer, dict) and producer.get("name") == "modelopt"
    ):
        nested = quant.get("quantization")
        settings = nested if isinstance(nested, dict) else quant
        algo = settings.get("quant_algo")
        return isinstance(algo, str) and algo.upper() in MODELOPT_FP8_ALGOS
    if method != "compressed-tensors" or not isinstance(quant.get("config_groups"), dict):
        return False
    groups = [g for g in quant["config_groups"].values() if isinstance(g, dict)]
    weights = [g.get("weights") for g in groups]
    return bool(weights) and all(
        isinstance(w, dict) and w.get("type") == "float" and w.get("num_bits") == 8 for w in weights
    )


def _fp8_block_columns(quant: Any) -> int | None:
    """The input columns of a block-wise FP8 checkpoint's scale blocks: `weight_block_size`
    ([rows, cols]) of `quant_method: fp8`, or the first `block_structure` of compressed-tensors'
    block strategy (as the engine reads them, loader/hf_config.py); None otherwise."""
    if not _fp8_checkpoint(quant):
        return None
    size = quant.get("weight_block_size")
    if size is None and isinstance(quant.get("config_groups"), dict):
        for group in quant["config_groups"].values():
            weights = group.get("weights") if isinstance(group, dict) else None
            if isinstance(weights, dict) and weights.get("block_structure") is not None:
                size = weights["block_structure"]
                break
    if isinstance(size, list | tuple) and len(size) == 2 and isinstance(size[1], int):
        return size[1] if size[1] >= 1 else None
    return None


def with_shape(catalog: ShapeCatalog, name: str, shape: ModelShape) -> ShapeCatalog:
    """The catalog plus `shape` under `name` (a repository id); the catalog's own entry wins."""
    if catalog.find(name) is not None:
        return catalog
    named = shape.model_copy(update={"names": (name,)})
    return catalog.model_copy(update={"shapes": {**catalog.shapes, name.lower(): named}})


@dataclass(frozen=True)
class Limits:
    """The spec's limits with the engine defaults filled in."""

    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float


def effective_limits(spec: InferenceServiceSpec, shape: ModelShape) -> Limits:
    lim = spec.limits
    return Limits(
        max_model_len=lim.max_model_len or shape.max_position_embeddings,
        max_num_seqs=lim.max_num_seqs or engine_defaults.MAX_NUM_SEQS,
        max_num_batched_tokens=lim.max_num_batched_tokens or engine_defaults.MAX_NUM_BATCHED_TOKENS,
        gpu_memory_utilization=lim.gpu_memory_utilization or engine_defaults.GPU_MEMORY_UTILIZATION,
    )


@dataclass(frozen=True)
class Precision:
    """Bytes per element the engine stores: decoder projection weights, the KV cache and
    whether the LM head is one byte per weight (embeddings, norms and activations stay in the
    accelerator dtype, and so does the LM head unless `one_byte_lm_head`)."""

    projection_bytes: int = ACCELERATOR_DTYPE_BYTES
    kv_bytes: int = ACCELERATOR_DTYPE_BYTES
    # engine.lmHeadQuantization fp8 or int8: a byte per head weight and a scale per row.
    one_byte_lm_head: bool = False
    # A block-wise FP8 checkpoint served with its own scales (engine.extraArgs
    # `--fp8-block-scales native`): one scale per output row and this many input columns.
    block_scale_columns: int | None = None

    @classmethod
    def of(cls, spec: InferenceServiceSpec, shape: ModelShape | None = None) -> Precision:
        """engine.quantization fp8, or a checkpoint whose shape says its projections are FP8
        (`fp8_projections`, from its config.json): one byte per projection weight;
        engine.kvCacheDtype fp8: one byte per KV element; engine.lmHeadQuantization fp8 or int8:
        an LM head of one byte per weight."""
        fp8 = spec.engine.quantization == "fp8" or (shape is not None and shape.fp8_projections)
        native = _extra_arg(spec, BLOCK_SCALES_FLAG) == "native"
        columns = shape.fp8_block_columns if shape is not None and native else None
        return cls(
            projection_bytes=FP8_BYTES if fp8 else ACCELERATOR_DTYPE_BYTES,
            kv_bytes=FP8_BYTES if spec.engine.kv_cache_dtype == "fp8" else ACCELERATOR_DTYPE_BYTES,
            one_byte_lm_head=spec.engine.lm_head_quantization in ONE_BYTE_LM_HEADS,
            block_scale_columns=columns if spec.engine.type == "davit" else None,
        )


# The engine flag that serves block-wise FP8 checkpoints with their own scales (no typed field:
# engine.extraArgs carries it).
BLOCK_SCALES_FLAG = "--fp8-block-scales"


def _extra_arg(spec: InferenceServiceSpec, flag: str) -> str | None:
    """The value `flag` takes in engine.extraArgs (`--flag value` or `--flag=value`; the last
    wins, as the engine's parser takes it), or None."""
    value = None
    args = list(spec.engine.extra_args)
    for i, arg in enumerate(args):
        name, sep, inline = arg.partition("=")
        if name != flag:
            continue
        if sep:
            value = inline
        elif i + 1 < len(args):
            value = args[i + 1]
    return value


def weight_bytes(shape: ModelShape, dtype_bytes: int, precision: Precision) -> int:
    """Bytes of the model's weights: projections at `precision` (with FP8's channel scales),
    everything else at `dtype_bytes`. A one-byte LM head (fp8 or int8) holds one byte per weight
    and a float32 scale per row; tied to the embedding, it is a copy beside the embedding (which
    keeps `dtype_bytes`)."""
    projections = shape.projection_parameters
    total = (
        shape.num_parameters - projections
    ) * dtype_bytes + projections * precision.projection_bytes
    if precision.projection_bytes == FP8_BYTES and precision.block_scale_columns:
        total += shape.projection_scale_groups(precision.block_scale_columns) * FP8_SCALE_BYTES
    elif precision.projection_bytes == FP8_BYTES:
        total += shape.projection_channels * FP8_SCALE_BYTES
    if precision.one_byte_lm_head:
        head = shape.vocab_size * shape.hidden_size
        if not shape.tie_word_embeddings:
            total -= head * dtype_bytes
        total += head * LM_HEAD_WEIGHT_BYTES + shape.vocab_size * LM_HEAD_ROW_SCALE_BYTES
    return total


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device of one tensor-parallel rank, from the shape alone."""

    device_bytes: int
    budget_bytes: int
    weights_bytes: int
    activation_bytes: int
    cuda_graph_bytes: int
    non_torch_bytes: int
    kv_bytes_per_token: int
    max_model_len: int
    largest_max_model_len: int

    @property
    def fixed_bytes(self) -> int:
        return (
            self.weights_bytes
            + self.activation_bytes
            + self.cuda_graph_bytes
            + self.non_torch_bytes
        )

    @property
    def one_sequence_bytes(self) -> int:
        return self.kv_bytes_per_token * self.max_model_len

    @property
    def fits(self) -> bool:
        return self.fixed_bytes + self.one_sequence_bytes <= self.budget_bytes

    @property
    def kv_cache_bytes(self) -> int:
        return max(0, self.budget_bytes - self.fixed_bytes)


def estimate_memory(
    shape: ModelShape,
    limits: Limits,
    device_bytes: int,
    tensor_parallel: int,
    dtype_bytes: int = ACCELERATOR_DTYPE_BYTES,
    draft: ModelShape | None = None,
    precision: Precision = Precision(),
) -> MemoryEstimate:
    """Weights, activations at the token budget, the sampler's logits, a CUDA-graph allowance
    and a non-torch allowance per rank; what is left is KV cache. A speculative draft model
    adds its weights, its graphs and its share of every KV block (its cache follows the
    model's block tables). `precision` sets the bytes of the projections and of the KV cache
    (FP8: one byte each) and of the LM head."""
    tp = tensor_parallel
    kv_heads = -(-shape.num_kv_heads // tp)
    per_token = 2 * shape.num_layers * kv_heads * shape.head_dim * precision.kv_bytes
    weights = weight_bytes(shape, dtype_bytes, precision) // tp
    if draft is not None:
        per_token += 2 * draft.num_layers * draft.num_kv_heads * draft.head_dim * precision.kv_bytes
        weights += draft.num_parameters * dtype_bytes
    t = limits.max_num_batched_tokens
    width = (
        4 * shape.hidden_size
        + (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim // tp
        + 2 * shape.intermediate_size // tp
    )
    logits = limits.max_num_seqs * shape.vocab_size * 4
    activation = t * width * dtype_bytes + 3 * logits
    graphs = cuda_graph_estimate(
        limits.max_num_seqs,
        shape.vocab_size,
        shape.hidden_size,
        shape.intermediate_size,
        dtype_bytes,
    )
    if draft is not None:
        graphs += cuda_graph_estimate(
            limits.max_num_seqs,
            draft.vocab_size,
            draft.hidden_size,
            draft.intermediate_size,
            dtype_bytes,
        )
    budget = int(device_bytes * limits.gpu_memory_utilization)
    room = budget - (weights + activation + graphs + NON_TORCH_ESTIMATE_BYTES)
    largest = 0
    if room > 0:
        largest = room // per_token // engine_defaults.BLOCK_SIZE * engine_defaults.BLOCK_SIZE
        largest = min(largest, shape.max_position_embeddings)
    return MemoryEstimate(
        device_bytes=device_bytes,
        budget_bytes=budget,
        weights_bytes=weights,
        activation_bytes=activation,
        cuda_graph_bytes=graphs,
        non_torch_bytes=NON_TORCH_ESTIMATE_BYTES,
        kv_bytes_per_token=per_token,
        max_model_len=limits.max_model_len,
        largest_max_model_len=int(largest),
    )


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def preflight(
    spec: InferenceServiceSpec,
    catalog: ShapeCatalog,
    product: str | None,
    tensor_limit: Callable[[int], str | None] = lambda _: None,
) -> MemoryEstimate | None:
    """The estimate for one full-length sequence per tensor-parallel group; None when the shape
    or the device memory is unknown. Raises PlanError (InsufficientMemory) when it cannot fit,
    with the numbers and the largest maxModelLen that would, or the tensor-parallel size that
    would; `tensor_limit(size)` says why the engine release cannot run that size (None: it can)."""
    shape = shape_for(spec, catalog)
    device = catalog.device_bytes(product)
    has_draft, draft = draft_shape_for(spec, catalog)
    if shape is None or device is None or (has_draft and draft is None):
        return None  # an unknown draft shape too: the engine's profile counts it
    limits = effective_limits(spec, shape)
    tp = spec.parallelism.tensor
    precision = Precision.of(spec, shape)
    estimate = estimate_memory(shape, limits, device, tp, draft=draft, precision=precision)
    if estimate.fits:
        return estimate
    need = estimate.fixed_bytes + estimate.one_sequence_bytes
    detail = (
        f"{spec.model.source} needs {_gib(need)} per GPU at maxModelLen {limits.max_model_len} "
        f"(weights {_gib(estimate.weights_bytes)}, activations {_gib(estimate.activation_bytes)}"
        f", CUDA graphs {_gib(estimate.cuda_graph_bytes)}, outside torch "
        f"{_gib(estimate.non_torch_bytes)}, KV for one sequence "
        f"{_gib(estimate.one_sequence_bytes)}) but {product} x{tp} (tensor parallel) gives "
        f"{_gib(estimate.budget_bytes)} per GPU at gpuMemoryUtilization "
        f"{limits.gpu_memory_utilization}"
    )
    if estimate.largest_max_model_len > 0:
        advice = f"the largest maxModelLen that fits is {estimate.largest_max_model_len}"
        field = "limits.maxModelLen"
    else:
        fitting = [
            n
            for n in (2, 4, 8, 16)
            if n > tp
            and estimate_memory(shape, limits, device, n, draft=draft, precision=precision).fits
        ]
        advice = "no maxModelLen fits: the weights alone do not"
        if fitting:
            advice += f"; parallelism.tensor {fitting[0]} would fit"
            beyond = tensor_limit(fitting[0])
            if beyond is not None:
                advice += f", but {beyond}"
        field = "parallelism.tensor"
    raise PlanError(
        field=field,
        value=limits.max_model_len,
        reason="InsufficientMemory",
        condition="",
        message=f"{detail}; {advice}",
    )


def profile_identity(plan: Plan) -> dict[str, Any]:
    """What a profile's numbers depend on, as far as the operator knows before any pod runs."""
    spec = plan.spec
    p = spec.parallelism
    identity = {
        "image": plan.image.digest or plan.image.reference,
        "engine": f"{plan.image.engine_type} {plan.image.engine_version}",
        "model": spec.model.source,
        "file": spec.model.file or "",
        "revision": spec.model.revision or "",
        "accelerator": f"{spec.accelerator.vendor}/{spec.accelerator.product or ''}",
        "count": plan.placement.summary,
        "parallelism": [p.tensor, p.pipeline, p.data],
        "limits": spec.limits.model_dump(by_alias=True, exclude={"kv_cache_memory_bytes"}),
        "runner": plan.runner.name,
        "extraArgs": list(spec.engine.extra_args),
    }
    # Set only when not the default, so identities from before these fields keep their hash.
    if spec.engine.quantization is not None:
        identity["quantization"] = spec.engine.quantization
    if spec.engine.kv_cache_dtype != "auto":
        identity["kvCacheDtype"] = spec.engine.kv_cache_dtype
    if spec.engine.lm_head_quantization is not None:
        identity["lmHeadQuantization"] = spec.engine.lm_head_quantization
    if spec.features.speculative is not None:
        # A draft model's weights, KV and graphs are in the measured profile.
        identity["speculative"] = spec.features.speculative.model_dump(
            by_alias=True, exclude_none=True
        )
    return identity


def identity_hash(identity: dict[str, Any]) -> str:
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class MemoryPlan:
    """The memory plan reported in status (bytes per GPU of one replica)."""

    source: MemorySource
    identity_hash: str
    message: str
    kv_cache_bytes: int | None = None
    weights_bytes: int | None = None
    activation_bytes: int | None = None
    cuda_graph_bytes: int | None = None
    runner_buffer_bytes: int | None = None
    non_torch_bytes: int | None = None
    token_capacity: int | None = None
    max_model_len: int | None = None
    max_concurrency: float | None = None
    profile_name: str | None = None
    # KV offload tiers' capacities in tokens (features.kvCacheOffloading), None without one.
    cpu_offload_tokens: int | None = None
    disk_offload_tokens: int | None = None

    def to_status(self) -> MemoryPlanStatus:
        """The status's memoryPlan; fields without a value are left unset."""
        fields = {
            "source": self.source,
            "identityHash": self.identity_hash,
            "message": self.message,
            "profile": self.profile_name,
            "kvCacheBytes": self.kv_cache_bytes,
            "weightsBytes": self.weights_bytes,
            "activationBytes": self.activation_bytes,
            "cudaGraphBytes": self.cuda_graph_bytes,
            "runnerBufferBytes": self.runner_buffer_bytes,
            "nonTorchBytes": self.non_torch_bytes,
            "tokenCapacity": self.token_capacity,
            "maxModelLen": self.max_model_len,
            "maxConcurrency": str(self.max_concurrency)
            if self.max_concurrency is not None
            else None,
            "cpuOffloadTokenCapacity": self.cpu_offload_tokens,
            "diskOffloadTokenCapacity": self.disk_offload_tokens,
        }
        return MemoryPlanStatus.model_validate({k: v for k, v in fields.items() if v is not None})


def _capacity(kv_bytes: int, per_token: int, max_model_len: int) -> tuple[int, float]:
    tokens = kv_bytes // per_token // engine_defaults.BLOCK_SIZE * engine_defaults.BLOCK_SIZE
    return int(tokens), round(tokens / max_model_len, 2)


def estimate_plan(estimate: MemoryEstimate, identity: str, source: MemorySource) -> MemoryPlan:
    tokens, concurrency = _capacity(
        estimate.kv_cache_bytes, estimate.kv_bytes_per_token, estimate.max_model_len
    )
    return MemoryPlan(
        source=source,
        identity_hash=identity,
        message="estimated from the model shape and the accelerator memory",
        kv_cache_bytes=estimate.kv_cache_bytes,
        weights_bytes=estimate.weights_bytes,
        activation_bytes=estimate.activation_bytes,
        cuda_graph_bytes=estimate.cuda_graph_bytes,
        non_torch_bytes=estimate.non_torch_bytes,
        token_capacity=tokens,
        max_model_len=estimate.max_model_len,
        max_concurrency=concurrency,
    )


def explicit_plan(
    kv_bytes: int, estimate: MemoryEstimate | None, identity: str, limits_len: int | None
) -> MemoryPlan:
    tokens = concurrency = None
    max_len = limits_len or (estimate.max_model_len if estimate else None)
    if estimate is not None and max_len:
        tokens, concurrency = _capacity(kv_bytes, estimate.kv_bytes_per_token, max_len)
    return MemoryPlan(
        source="explicit",
        identity_hash=identity,
        message="limits.kvCacheMemoryBytes",
        kv_cache_bytes=kv_bytes,
        token_capacity=tokens,
        max_model_len=max_len,
        max_concurrency=concurrency,
    )


def profile_plan(profile: MemoryProfile, identity: str, profile_name: str) -> MemoryPlan:
    m = profile.memory
    return MemoryPlan(
        source="profile",
        identity_hash=identity,
        message=(
            f"measured by engine {profile.identity.engine_version} on "
            f"{profile.identity.gpu_product or profile.identity.device} ({m.method})"
        ),
        kv_cache_bytes=m.kv_cache_bytes,
        weights_bytes=m.weights_bytes,
        activation_bytes=m.activation_peak_bytes,
        cuda_graph_bytes=m.cuda_graph_bytes,
        runner_buffer_bytes=m.runner_buffer_bytes,
        non_torch_bytes=m.non_torch_bytes,
        token_capacity=m.token_capacity,
        max_model_len=profile.identity.max_model_len,
        max_concurrency=m.max_concurrency,
        profile_name=profile_name,
        # Measured by the engine with the replicas' own offload flags, when it has tiers.
        cpu_offload_tokens=(profile.offload or {}).get("cpu_token_capacity") or None,
        disk_offload_tokens=(profile.offload or {}).get("disk_token_capacity") or None,
    )


def with_offload_tokens(spec: InferenceServiceSpec, memory: MemoryPlan) -> MemoryPlan:
    """`memory` with the KV offload tiers' token capacities, from the spec's sizes and the KV
    bytes per block the plan implies (kept when a profile measured them)."""
    if spec.features.kv_cache_offloading is None:
        return memory
    if memory.cpu_offload_tokens is not None or memory.disk_offload_tokens is not None:
        return memory
    if not memory.kv_cache_bytes or not memory.token_capacity:
        return memory
    block_size = engine_defaults.BLOCK_SIZE
    block_bytes = memory.kv_cache_bytes // (memory.token_capacity // block_size)
    cpu, disk = tier_tokens(spec, block_bytes, block_size)
    return replace(memory, cpu_offload_tokens=cpu, disk_offload_tokens=disk)


def with_memory(plan: Plan, memory: MemoryPlan) -> Plan:
    """The plan with `memory` in it; explicit and profiled KV bytes become the engine flag."""
    memory = with_offload_tokens(plan.spec, memory)
    invocation = plan.invocation
    if memory.source in ("explicit", "profile") and memory.kv_cache_bytes is not None:
        args = list(invocation.args)
        if KV_FLAG in args:
            i = args.index(KV_FLAG)
            del args[i : i + 2]
        args += [KV_FLAG, str(memory.kv_cache_bytes)]
        invocation = replace(invocation, args=args)
    return replace(plan, invocation=invocation, memory=memory)
