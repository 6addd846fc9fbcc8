"""Engine configuration: one frozen dataclass built from CLI flags or the offline API."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from davit_contract import engine_defaults
from davit_engine.spec_decode.config import SpeculativeConfig
from davit_engine.types import ParamError

RunnerKind = Literal["auto", "v1", "v2"]
DType = Literal["auto", "float32", "bfloat16", "float16"]
# FP8 flags (davit_engine.quant): "fp8" is e4m3, as upstream's default FP8 format.
KvCacheDType = Literal["auto", "fp8", "fp8_e4m3"]
Quantization = Literal["fp8"]
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8", "fp8_e4m3")
QUANTIZATIONS: tuple[str, ...] = ("fp8",)
# --lm-head-quantization (no upstream flag): the LM head's weight in one byte too, FP8 (e4m3,
# needs FP8 hardware) or int8 (any device; about four times FP8's precision at the same
# bytes), one scale per row either way. Lossy beyond the projections' FP8; never on unless
# asked.
LmHeadQuantization = Literal["fp8", "int8"]
LM_HEAD_QUANTIZATIONS: tuple[str, ...] = ("fp8", "int8")
# --fp8-block-scales (no upstream flag): how block-wise FP8 checkpoints are served. "channel"
# re-quantizes them to one scale per output channel at load (the tuned per-channel products;
# one more e4m3 rounding of some values), "native" multiplies with the checkpoint's own block
# scales (its values exactly; quant/fp8_block_linear.py).
FP8_BLOCK_SCALES: tuple[str, ...] = ("channel", "native")
# --kv-offloading-backend values: upstream also names "lmcache" (an external server).
KV_OFFLOADING_BACKENDS: tuple[str, ...] = ("native",)
# Tensor-parallel ranks are processes of one pod, so of one host: at most its GPUs.
MAX_TENSOR_PARALLEL_SIZE = 8


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start. Flag names mirror the upstream engine's.

    `model` is a Hugging Face safetensors directory, a `.gguf` file, or `random:<shape>` for
    random weights of a named shape (`smollm2-135m`, `qwen3-0.6b`, `llama-3.1-8b`, ...).
    """

    model: str
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: DType = "auto"
    # FP8 projection weights (None: as the checkpoint stores them) and KV-cache element type.
    quantization: Quantization | None = None
    kv_cache_dtype: KvCacheDType = "auto"
    # The LM head's weight in FP8 or int8 (per-row scales; the embedding keeps the model dtype).
    lm_head_quantization: LmHeadQuantization | None = None
    # Block-wise FP8 checkpoints: "channel" (re-quantized at load) or "native" (their scales).
    fp8_block_scales: str = "channel"
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0
    max_model_len: int | None = None  # None: from the model config, capped by KV capacity
    block_size: int = engine_defaults.BLOCK_SIZE
    max_num_seqs: int = engine_defaults.MAX_NUM_SEQS
    max_num_batched_tokens: int = engine_defaults.MAX_NUM_BATCHED_TOKENS
    max_queue_len: int | None = None  # None: unbounded waiting queue
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    num_gpu_blocks: int | None = None  # explicit KV block count (overrides memory sizing)
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = engine_defaults.GPU_MEMORY_UTILIZATION
    runner: RunnerKind = "auto"
    enforce_eager: bool = False
    # Schedule step N+1 while the device runs step N, where the runner supports it (V2).
    async_scheduling: bool = True
    revision: str | None = None  # model revision (hf:// sources; informational otherwise)
    # Custom logits processors to import and apply to every request (`module.Class`); they
    # need runner V1.
    logits_processors: tuple[str, ...] = ()
    max_logprobs: int = 20
    trust_remote_code: bool = False
    # --speculative-config, validated (runner V2 only).
    speculative_config: SpeculativeConfig | None = None
    # KV offload tiers below the GPU prefix cache (davit_engine.offload): the CPU tier in GiB
    # (upstream's --kv-offloading-size, its name and unit) and its backend, and the disk tier's
    # folder and size in bytes (no upstream flag of its own).
    kv_offloading_size: float | None = None
    kv_offloading_backend: str = "native"
    kv_offload_disk_path: str | None = None
    kv_offload_disk_bytes: int | None = None
    # Ranks (one process and device each) that split every layer's heads and MLP columns;
    # 1: the whole model in the engine-core process.
    tensor_parallel_size: int = 1

    def validate(self) -> None:
        if self.block_size not in engine_defaults.BLOCK_SIZES:
            raise ParamError(
                "--block-size", f"must be one of 8/16/32/64/128, got {self.block_size}"
            )
        if self.max_num_seqs < 1:
            raise ParamError("--max-num-seqs", f"must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ParamError(
                "--max-num-batched-tokens",
                f"must be at least 1, got {self.max_num_batched_tokens}",
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ParamError("--max-model-len", f"must be at least 1, got {self.max_model_len}")
        if (
            not self.enable_chunked_prefill
            and self.max_model_len is not None
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ParamError(
                "--max-num-batched-tokens",
                "must be >= --max-model-len when chunked prefill is disabled",
            )
        if self.max_queue_len is not None and self.max_queue_len < 0:
            raise ParamError("--max-queue-len", f"must be >= 0, got {self.max_queue_len}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ParamError(
                "--gpu-memory-utilization",
                f"must be in (0, 1], got {self.gpu_memory_utilization}",
            )
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ParamError("--num-gpu-blocks-override", "must be at least 1")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ParamError("--kv-cache-memory-bytes", "must be positive")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ParamError(
                "--kv-cache-dtype",
                f"must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}",
            )
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ParamError(
                "--quantization",
                f"must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}",
            )
        if (
            self.lm_head_quantization is not None
            and self.lm_head_quantization not in LM_HEAD_QUANTIZATIONS
        ):
            raise ParamError(
                "--lm-head-quantization",
                f"must be one of {', '.join(LM_HEAD_QUANTIZATIONS)}, got "
                f"{self.lm_head_quantization!r}",
            )
        if self.fp8_block_scales not in FP8_BLOCK_SCALES:
            raise ParamError(
                "--fp8-block-scales",
                f"must be one of {', '.join(FP8_BLOCK_SCALES)}, got {self.fp8_block_scales!r}",
            )
        if self.speculative_config is not None:
            self.speculative_config.validate()
        self._validate_offload()
        self._validate_tensor_parallel()

    def _validate_tensor_parallel(self) -> None:
        flag = "--tensor-parallel-size"
        size = self.tensor_parallel_size
        if (
            isinstance(size, bool)
            or not isinstance(size, int)
            or not 1 <= size <= MAX_TENSOR_PARALLEL_SIZE
        ):
            raise ParamError(
                flag,
                f"must be an integer between 1 and {MAX_TENSOR_PARALLEL_SIZE} (the GPUs of one "
                f"host: the ranks are processes of one pod), got {size!r}",
            )
        if size == 1:
            return
        # Both keep per-request state (drafts, offloaded blocks) that only rank 0 would hold.
        if self.speculative_config is not None:
            raise ParamError(
                "--speculative-config",
                f"speculative decoding is not supported with {flag} {size} yet: drop one of them",
            )
        if self.has_kv_offload:
            offload_flag = (
                "--kv-offloading-size"
                if self.kv_offloading_size is not None
                else "--kv-offload-disk-path"
            )
            raise ParamError(
                offload_flag,
                f"KV offload is not supported with {flag} {size} yet: drop one of them",
            )

    def _validate_offload(self) -> None:
        size = self.kv_offloading_size
        if size is not None and not (size > 0 and size < float("inf")):
            raise ParamError(
                "--kv-offloading-size", f"must be a positive number of GiB, got {size}"
            )
        if self.kv_offloading_backend not in KV_OFFLOADING_BACKENDS:
            raise ParamError(
                "--kv-offloading-backend",
                f"must be one of {', '.join(KV_OFFLOADING_BACKENDS)} (Davit has no LMCache "
                f"connector), got {self.kv_offloading_backend!r}",
            )
        has_path = self.kv_offload_disk_path is not None
        has_bytes = self.kv_offload_disk_bytes is not None
        if has_path != has_bytes:
            missing = "--kv-offload-disk-bytes" if has_path else "--kv-offload-disk-path"
            raise ParamError(missing, "the disk tier needs both a folder and a size")
        if self.kv_offload_disk_bytes is not None and self.kv_offload_disk_bytes < 1:
            raise ParamError("--kv-offload-disk-bytes", "must be positive")
        if self.kv_offload_disk_path == "":
            raise ParamError("--kv-offload-disk-path", "must name a folder")
        if self.has_kv_offload and not self.enable_prefix_caching:
            flag = "--kv-offloading-size" if size is not None else "--kv-offload-disk-path"
            raise ParamError(
                flag, "KV offload stores prefix-cache blocks: it needs --enable-prefix-caching"
            )

    @property
    def has_kv_offload(self) -> bool:
        return self.kv_offloading_size is not None or self.kv_offload_disk_path is not None

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model
