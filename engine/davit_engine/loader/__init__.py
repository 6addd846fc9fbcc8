"""Model loading: Hugging Face safetensors directories, GGUF files and random weights.

`load_model(config, device)` returns a `LoadedModel`: the module with weights in place on
`device`, its `ModelConfig` and the dtype picked. Every failure is a ParamError naming the file
or field so `davit serve` can say exactly what to fix.

FP8 (davit_engine.quant): an FP8 checkpoint (quantization_config) is built with `Fp8Linear`
projections that its weights and scales load into; `--quantization fp8` on any other checkpoint
quantizes the projections once the weights are in place. With `--kv-cache-dtype fp8` every
attention layer gets its KV scales from a calibration prefill, after the projections are final
(so the calibration sees the weights that will serve).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from davit_engine.config import EngineConfig
from davit_engine.kernels.fp8_block import kernel_group
from davit_engine.layers.parallel import TensorParallel
from davit_engine.layers.rotary import RotaryEmbedding
from davit_engine.loader import gguf_file, safetensors_dir
from davit_engine.loader.random_weights import fill_random, iter_random_weights
from davit_engine.models.config import ModelConfig, WeightBlocks
from davit_engine.models.llama import LlamaAttention, LlamaForCausalLM
from davit_engine.models.parallel import parallelize, rank_config, shard_weights
from davit_engine.quant.block_fp8 import convert_block_scaled
from davit_engine.quant.fp8_block_linear import (
    Fp8BlockLinear,
    install_fp8_block_projections,
    prepare_block_projections,
)
from davit_engine.quant.fp8_linear import (
    install_fp8_projections,
    quantize_lm_head,
    quantize_projections,
    quantize_weight_stream,
)
from davit_engine.quant.kv_scales import calibrate_kv_scales
from davit_engine.quant.support import (
    check_fp8_device,
    is_fp8_kv,
    kv_cache_dtype_name,
    kv_storage_dtype,
)
from davit_engine.shapes import get_shape
from davit_engine.types import ParamError

logger = logging.getLogger(__name__)

RANDOM_PREFIX = "random:"
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    dtype: torch.dtype  # of the activations (and of every weight that is not FP8)
    source: str  # "gguf", "safetensors" or "random"
    quantization: str = "none"  # "fp8": the decoder projections hold FP8 weights
    # "fp8" or "int8": the LM head's weight in one byte (--lm-head-quantization)
    lm_head_quantization: str = "none"
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype) or "fp8" (e4m3)
    kv_scale_source: str = "none"  # FP8 KV scales: "calibrated", or "none" without FP8 KV
    # "native": block-wise FP8 weights served with their own scales (--fp8-block-scales)
    fp8_block_scales: str = "channel"
    # This process's rank when the model is split over several (None: the whole model here).
    tensor_parallel: TensorParallel | None = None

    @property
    def rank_config(self) -> ModelConfig:
        """The shapes this process holds: `config`, or one rank's heads and MLP columns under
        tensor parallelism (its KV cache has the rank's KV heads only)."""
        return self.config if self.tensor_parallel is None else self.model.config

    @property
    def kv_storage_dtype(self) -> torch.dtype:
        """Element type of the KV cache tensors."""
        return kv_storage_dtype(self.kv_cache_dtype, self.dtype)

    @property
    def num_parameters(self) -> int:
        return self.config.num_parameters()


def model_kind(model: str) -> str:
    """ "random", "gguf" or "safetensors" for a --model value (no file access for random)."""
    if model.startswith(RANDOM_PREFIX):
        return "random"
    if model.endswith(".gguf"):
        return "gguf"
    return "safetensors"


def read_model_config(model: str) -> ModelConfig:
    """The architecture of a --model value without loading its weights."""
    kind = model_kind(model)
    if kind == "random":
        return get_shape(model.removeprefix(RANDOM_PREFIX))
    path = Path(model)
    if kind == "gguf":
        return gguf_file.read_config(path)
    if not path.exists():
        raise ParamError(
            "model",
            f"{model}: no such file or directory (under the Davit operator: check the "
            "InferenceService's spec.model.source, and spec.model.file for a GGUF file)",
        )
    if not path.is_dir():
        raise ParamError(
            "model", f"{model}: expected a Hugging Face directory, a .gguf file or random:<shape>"
        )
    return safetensors_dir.read_config(path)


def resolve_dtype(
    requested: str, kind: str, config: ModelConfig, device: torch.device
) -> torch.dtype:
    if requested != "auto":
        if requested not in DTYPES:
            raise ParamError(
                "--dtype", f"must be one of auto, {', '.join(DTYPES)}; got {requested!r}"
            )
        return DTYPES[requested]
    if kind == "safetensors" and config.torch_dtype in DTYPES:
        checkpoint = DTYPES[str(config.torch_dtype)]
        # Half precision on CPU is slow and lossy for no gain in memory we need.
        return checkpoint if device.type != "cpu" else torch.float32
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def build_empty(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    fp8_projections: bool = False,
    tensor_parallel: TensorParallel | None = None,
    fp8_block_group: int | None = None,
) -> LlamaForCausalLM:
    """The module with uninitialised weights of `dtype` on `device` (no default init cost);
    with `fp8_projections`, the decoder projections are `Fp8Linear` (for FP8 checkpoints), or
    with `fp8_block_group` too `Fp8BlockLinear` with scales per row and that many columns
    (block-wise FP8 checkpoints served with their own scales); with `tensor_parallel`, one
    rank's part of the model (models/parallel.py)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            if tensor_parallel is None:
                model = LlamaForCausalLM(config)
            else:
                model = LlamaForCausalLM(rank_config(config, tensor_parallel.size))
                parallelize(model, config, tensor_parallel)
            if fp8_projections and fp8_block_group is not None:
                install_fp8_block_projections(model, fp8_block_group)
            elif fp8_projections:
                install_fp8_projections(model)
    finally:
        torch.set_default_dtype(previous)
    model.to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty() gives the shared weight one fresh tensor
        model.lm_head.weight = model.model.embed_tokens.weight
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.build_tables(device)
        if isinstance(module, LlamaAttention):
            module.kv_scale.fill_(1.0)  # to_empty() leaves buffers uninitialised too
    return model.eval()


def resolve_quantization(requested: str | None, config: ModelConfig, model: str) -> str:
    """ "fp8" when the flag asks for it or the checkpoint is FP8, else "none"."""
    if requested is not None and requested != "fp8":
        raise ParamError("--quantization", f"must be fp8, got {requested!r}")
    if config.quantization == "fp8" or requested == "fp8":
        return "fp8"
    return "none"


def load_model(
    config: EngineConfig, device: torch.device, tensor_parallel: TensorParallel | None = None
) -> LoadedModel:
    """Load the model on `device`; with `tensor_parallel`, only this rank's part of it (each
    checkpoint tensor is cut as it is read)."""
    kind = model_kind(config.model)
    weights: Iterable[tuple[str, torch.Tensor]] | None = None
    if kind == "gguf":
        model_config, weights = gguf_file.load(Path(config.model))
    else:
        model_config = read_model_config(config.model)
    quantization = resolve_quantization(config.quantization, model_config, config.model)
    if tensor_parallel is not None:
        check_tensor_parallel(config, model_config)
    if quantization == "fp8":
        flag = "--quantization" if config.quantization else "model"
        check_fp8_device(device, flag, f"{config.model}: fp8 quantization")
    fp8_kv = is_fp8_kv(config.kv_cache_dtype)
    if fp8_kv:
        check_fp8_device(device, "--kv-cache-dtype", config.kv_cache_dtype)
    lm_head_quantization = config.lm_head_quantization or "none"
    if lm_head_quantization == "fp8":
        check_fp8_device(device, "--lm-head-quantization", "fp8")
    dtype = resolve_dtype(config.dtype, kind, model_config, device)
    prequantized = model_config.quantization == "fp8"
    # A tensor-parallel rank quantizes the checkpoint stream before cutting it (each rank then
    # holds its cut of the single-device quantization), so its model is built with FP8
    # projections like a pre-quantized checkpoint's.
    stream_quantized = tensor_parallel is not None and quantization == "fp8" and not prequantized
    native_blocks = native_block_scales(config, model_config, kind)
    model = build_empty(
        model_config,
        dtype,
        device,
        fp8_projections=prequantized or stream_quantized,
        tensor_parallel=tensor_parallel,
        fp8_block_group=native_blocks.cols if native_blocks is not None else None,
    )
    with torch.no_grad():
        if tensor_parallel is not None:
            if kind == "random":
                weights = iter_random_weights(model_config, config.seed, device)
            elif kind == "safetensors":
                weights = _safetensors_stream(
                    config.model, model_config, device, native_blocks is not None
                )
            assert weights is not None
            if stream_quantized:
                weights = quantize_weight_stream(weights, dtype, device)
            model.load_weights(shard_weights(weights, model_config, tensor_parallel), config.model)
        elif kind == "random":
            fill_random(model, config.seed)
        elif kind == "gguf":
            assert weights is not None
            model.load_weights(weights, config.model)
        else:
            model.load_weights(
                _safetensors_stream(config.model, model_config, device, native_blocks is not None),
                config.model,
            )
        if native_blocks is not None:
            library = prepare_block_projections(model)
            logger.info(
                "%s: FP8 weights with a scale per %dx%d block, served with those scales "
                "(--fp8-block-scales native; %d projections in the library's block-scaled "
                "GEMM past %d rows where it runs)",
                config.model, native_blocks.rows, native_blocks.cols, library,
                Fp8BlockLinear.weight_only_max_rows,
            )  # fmt: skip
        if stream_quantized:
            logger.info("quantized the decoder projections to fp8 (per-channel scales) as read")
        elif quantization == "fp8" and not prequantized:
            count = quantize_projections(model)
            logger.info("quantized %d projections to fp8 (per-channel scales)", count)
        if lm_head_quantization != "none":
            quantize_lm_head(model, lm_head_quantization)
            logger.warning(
                "--lm-head-quantization %s: the LM head's weight is %s (per-row scales); "
                "logits are rounded beyond the model dtype's",
                lm_head_quantization, lm_head_quantization.upper(),
            )  # fmt: skip
    if model_config.declares_fp8_kv and not fp8_kv:
        logger.info(
            "%s declares an FP8 KV cache; the cache stays in %s (it is lossy: "
            "--kv-cache-dtype fp8 turns it on, with scales calibrated at load)",
            config.model, dtype,
        )  # fmt: skip
    kv_scale_source = "none"
    if fp8_kv:
        calibrate_kv_scales(model, device, dtype, tensor_parallel=tensor_parallel)
        kv_scale_source = "calibrated"
        logger.info("fp8 KV cache: per-layer scales calibrated at load")
    logger.info(
        "loaded %s (%s, %s, %.1fM parameters) as %s on %s (projections: %s, LM head: %s)",
        config.model,
        kind,
        model_config.architecture,
        model_config.num_parameters() / 1e6,
        dtype,
        device,
        "fp8" if quantization == "fp8" else "model dtype",
        lm_head_quantization if lm_head_quantization != "none" else "model dtype",
    )
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the unquantized weights and the calibration's blocks
    return LoadedModel(
        model=model,
        config=dataclasses.replace(model_config, torch_dtype=str(dtype).removeprefix("torch.")),
        dtype=dtype,
        source=kind,
        quantization=quantization,
        lm_head_quantization=lm_head_quantization,
        kv_cache_dtype=kv_cache_dtype_name(config.kv_cache_dtype),
        kv_scale_source=kv_scale_source,
        tensor_parallel=tensor_parallel,
        fp8_block_scales="native" if native_blocks is not None else "channel",
    )


def native_block_scales(
    config: EngineConfig, model_config: ModelConfig, kind: str
) -> WeightBlocks | None:
    """The checkpoint's blocks where its block-wise FP8 weights are served with their own
    scales (`--fp8-block-scales native`), else None. The blocks' columns must be a width the
    Triton products take (`kernel_group`), and under tensor parallelism each rank's cut of a
    row-parallel projection (o_proj, down_proj: their input columns) must hold whole groups of
    scales; otherwise ParamError naming the flag."""
    if config.fp8_block_scales != "native":
        return None
    blocks = model_config.weight_blocks
    if blocks is None or kind != "safetensors":
        logger.info(
            "--fp8-block-scales native: %s has no block-wise FP8 weights, nothing to serve "
            "with block scales", config.model,
        )  # fmt: skip
        return None
    if not kernel_group(blocks.cols):
        raise ParamError(
            "--fp8-block-scales",
            f"native: the checkpoint's blocks are {blocks.cols} columns wide; the block-scaled "
            "products take a power of two from 16 to 256 (a decode step would otherwise widen "
            "every weight); use --fp8-block-scales channel",
        )
    size = config.tensor_parallel_size
    if size > 1:
        for what, columns in (
            ("o_proj", model_config.num_heads * model_config.head_dim),
            ("down_proj", model_config.intermediate_size),
        ):
            if columns % (size * blocks.cols):
                raise ParamError(
                    "--fp8-block-scales",
                    f"native: {what}'s {columns} input columns split {size} ways "
                    f"(--tensor-parallel-size) do not hold whole {blocks.cols}-column blocks "
                    "of the checkpoint's scales on every rank; use --fp8-block-scales channel",
                )
    return blocks


def _safetensors_stream(
    model: str, model_config: ModelConfig, device: torch.device, native: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """A safetensors directory's tensors, block-wise FP8 weights converted to channel scales,
    or with `native` their block scales expanded per row."""
    tensors = safetensors_dir.iter_weights(Path(model))
    blocks = model_config.weight_blocks
    if blocks is None:
        return tensors
    if native:
        return convert_block_scaled(tensors, blocks, model, device, native=True)
    logger.warning(
        "%s: FP8 weights with a scale per %dx%d block, re-quantized at load to one scale per "
        "output channel (values of blocks with a smaller scale than their row's largest are "
        "rounded to e4m3 a second time; docs/fp8.md gives the perplexity cost)",
        model, blocks.rows, blocks.cols,
    )  # fmt: skip
    return convert_block_scaled(tensors, blocks, model, device)


def check_tensor_parallel(config: EngineConfig, model_config: ModelConfig) -> None:
    """Refuse, naming --tensor-parallel-size, a size that does not divide the model's heads and
    MLP width, and naming --fp8-block-scales, native block scales the ranks cannot cut."""
    rank_config(model_config, config.tensor_parallel_size)
    native_block_scales(config, model_config, model_kind(config.model))
