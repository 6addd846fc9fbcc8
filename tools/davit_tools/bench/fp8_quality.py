"""Quality of FP8 weights and an FP8 KV cache against the unquantized model: perplexity on a
fixed text and greedy agreement, on any device.

- `perplexity`: the text's token ids go through the model in prefill chunks of `chunk` tokens
  over one paged KV cache of the configuration's element type, so every token after the first
  chunk attends to keys and values read back from that cache (FP8 ones included; within a
  chunk too, since the cache is written before attention reads it); the figure is
  exp(mean negative log-likelihood of each next token).
- `greedy_completions`: 32 prompts cut from the same text (`PROMPT_TOKENS` each, evenly spaced)
  run through an engine core with the configuration, `OUTPUT_TOKENS` greedy tokens each, EOS
  ignored; `agreement` compares two sets of completions token by token.

Configurations are `QualityConfig`s: the EngineConfig flags that matter (`quantization`,
`kv_cache_dtype`, `lm_head_quantization`), so the loader, the calibration of the KV scales and
the runner are the ones that serve.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

NUM_PROMPTS = 32
PROMPT_TOKENS = 48
OUTPUT_TOKENS = 32
CHUNK_TOKENS = 512
_BLOCK = 16


@dataclass(frozen=True)
class QualityConfig:
    """One column of the quality table: a name and the FP8 flags."""

    name: str
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    lm_head_quantization: str | None = None


CONFIGS = (
    QualityConfig("baseline"),
    QualityConfig("fp8-weights", quantization="fp8"),
    QualityConfig("fp8-kv", kv_cache_dtype="fp8"),
    QualityConfig("fp8-both", quantization="fp8", kv_cache_dtype="fp8"),
    # the LM head in FP8 too (--lm-head-quantization: lossy beyond the projections)
    QualityConfig("fp8-weights-lm-head", quantization="fp8", lm_head_quantization="fp8"),
    QualityConfig(
        "fp8-both-lm-head", quantization="fp8", kv_cache_dtype="fp8", lm_head_quantization="fp8"
    ),
    # or in int8 (per-row scales, about four times FP8's precision at the same bytes)
    QualityConfig("fp8-weights-lm-head-int8", quantization="fp8", lm_head_quantization="int8"),
    QualityConfig(
        "fp8-both-lm-head-int8",
        quantization="fp8",
        kv_cache_dtype="fp8",
        lm_head_quantization="int8",
    ),
)


def engine_config(base: Any, quality: QualityConfig) -> Any:
    """`base` (an EngineConfig) with the configuration's FP8 flags."""
    return dataclasses.replace(
        base,
        quantization=quality.quantization,
        kv_cache_dtype=quality.kv_cache_dtype,
        lm_head_quantization=quality.lm_head_quantization,
    )


def perplexity(loaded: Any, token_ids: list[int], device: torch.device, backend: Any = None,
               chunk: int = CHUNK_TOKENS) -> float:  # fmt: skip
    """Perplexity of `token_ids` under `loaded` (a LoadedModel), see the module docstring.
    `backend` defaults to the plain-torch paged attention."""
    from davit_engine.layers.attention import AttentionMetadata, TorchPagedAttention

    model, c = loaded.model, loaded.config
    num = len(token_ids)
    num_blocks = -(-num // _BLOCK)
    caches = [
        torch.zeros(2, num_blocks, _BLOCK, c.num_kv_heads, c.head_dim,
                    dtype=loaded.kv_storage_dtype, device=device)
        for _ in range(c.num_layers)
    ]  # fmt: skip
    ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
    tables = torch.arange(num_blocks, dtype=torch.int32, device=device)[None]
    total = 0.0
    with torch.inference_mode():
        for start in range(0, num - 1, chunk):
            end = min(num, start + chunk)
            positions = torch.arange(start, end, device=device)
            meta = AttentionMetadata(
                slot_mapping=positions,
                query_start_loc=torch.tensor([0, end - start], dtype=torch.int32, device=device),
                seq_lens=torch.tensor([end], dtype=torch.int32, device=device),
                block_tables=tables,
                max_query_len=end - start,
                max_seq_len=end,
                backend=backend or TorchPagedAttention(),
            )
            hidden = model(ids[start:end], positions, caches, meta)  # [n, hidden]
            targets = ids[start + 1 : end + 1]
            logits = model.compute_logits(hidden[: targets.shape[0]])  # [n', V] float32
            total += float(F.cross_entropy(logits, targets, reduction="sum"))
    return math.exp(total / (num - 1))


def measure(base: Any, quality: QualityConfig, token_ids: list[int], device: torch.device,
            backend: Any = None) -> dict[str, Any]:  # fmt: skip
    """One configuration's figures: the perplexity of `token_ids` (the model loaded on `device`,
    attention through `backend`) and its greedy completions of `agreement_prompts`. The model
    is released before the engine core of the completions loads its own."""
    from davit_engine.loader import load_model

    config = engine_config(base, quality)
    loaded = load_model(config, device)
    figures: dict[str, Any] = {"perplexity": perplexity(loaded, token_ids, device, backend)}
    del loaded
    if device.type == "cuda":
        torch.cuda.empty_cache()
    figures["completions"] = greedy_completions(config, agreement_prompts(token_ids))
    return figures


def agreement_prompts(token_ids: list[int]) -> list[list[int]]:
    """`NUM_PROMPTS` windows of `PROMPT_TOKENS` ids, evenly spaced over the text."""
    last = len(token_ids) - PROMPT_TOKENS
    stride = max(1, last // (NUM_PROMPTS - 1))
    return [token_ids[i * stride : i * stride + PROMPT_TOKENS] for i in range(NUM_PROMPTS)]


def greedy_completions(config: Any, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy completions (`OUTPUT_TOKENS`, EOS ignored) of every prompt, batched through an
    engine core built from `config` (an EngineConfig)."""
    from davit_engine.engine_core import EngineCore
    from davit_engine.types import EngineRequest, SamplingParams

    core = EngineCore(config)
    try:
        params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
        outputs: dict[str, list[int]] = {}
        for i, prompt in enumerate(prompts):
            core.add_request(EngineRequest(f"agree-{i}", list(prompt), params))
            outputs[f"agree-{i}"] = []
        while core.has_unfinished_requests():
            for delta in core.step():
                outputs[delta.request_id].extend(delta.new_token_ids)
    finally:
        core.shutdown()
    return [outputs[f"agree-{i}"] for i in range(len(prompts))]


@dataclass(frozen=True)
class Agreement:
    identical: int  # completions equal token for token
    first_token: int  # completions whose first token is equal
    mean_common_prefix: float  # tokens before the first difference, averaged
    total: int

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def agreement(reference: list[list[int]], other: list[list[int]]) -> Agreement:
    prefixes = []
    for ref, out in zip(reference, other, strict=True):
        n = 0
        while n < min(len(ref), len(out)) and ref[n] == out[n]:
            n += 1
        prefixes.append(n)
    return Agreement(
        identical=sum(r == o for r, o in zip(reference, other, strict=True)),
        first_token=sum(
            bool(r) and bool(o) and r[0] == o[0] for r, o in zip(reference, other, strict=True)
        ),
        mean_common_prefix=round(sum(prefixes) / len(prefixes), 2),
        total=len(reference),
    )


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def block_quantize(weight: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` [N, K] in FP8 with one scale per `rows` x `cols` block, as block-wise FP8
    checkpoints are written: a block's scale is its largest absolute value over 448 (1 for an
    all-zero block), edge blocks cover what is left. Returns (e4m3 codes [N, K], scales
    [ceil(N / rows), ceil(K / cols)] float32); a value is `code * scale` of its block."""
    n, k = weight.shape
    nb, kb = -(-n // rows), -(-k // cols)
    padded = torch.zeros(nb * rows, kb * cols, dtype=torch.float32)
    padded[:n, :k] = weight.float()
    amax = padded.view(nb, rows, kb, cols).abs().amax(dim=(1, 3))
    scales = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    full = _per_value(scales, rows, cols, (n, k))
    codes = (weight.float() / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    return codes, scales


def _per_value(scales: torch.Tensor, rows: int, cols: int, shape: tuple[int, int]) -> torch.Tensor:
    """Block scales [ceil(N / rows), ceil(K / cols)] spread to one per value [N, K]."""
    n, k = shape
    return scales.repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]


def write_block_fp8_checkpoint(
    config: Any, weights: Any, target: Any, block: tuple[int, int] = (128, 128),
    layout: str = "fp8", as_written: Any = None,
) -> None:  # fmt: skip
    """A safetensors checkpoint of `config` (a ModelConfig) and `weights` ((Hugging Face name,
    tensor) pairs) in `target`, every decoder projection block-quantized (`block_quantize`):
    `layout` "fp8" writes `quant_method: fp8` with `weight_block_size` and `weight_scale_inv`
    tensors, "compressed-tensors" its block strategy with `weight_scale` tensors. `as_written`
    (a directory): also the same checkpoint with every projection dequantized exactly into
    float32, the values the block checkpoint stands for."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    from davit_engine.loader.hf_config import model_config_to_hf

    rows, cols = block
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    suffix = ".weight_scale_inv" if layout == "fp8" else ".weight_scale"
    for name, tensor in weights:
        part = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
        if part not in PROJECTIONS:
            quantized[name] = dequantized[name] = tensor.contiguous()
            continue
        codes, scales = block_quantize(tensor, rows, cols)
        quantized[name] = codes
        quantized[name.removesuffix(".weight") + suffix] = scales
        dequantized[name] = codes.float() * _per_value(
            scales, rows, cols, (codes.shape[0], codes.shape[1])
        )
    raw = model_config_to_hf(config)
    if layout == "fp8":
        raw["quantization_config"] = {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [rows, cols],
        }  # fmt: skip
    elif layout == "compressed-tensors":
        raw["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"type": "float", "num_bits": 8, "strategy": "block",
                            "block_structure": [rows, cols], "symmetric": True, "dynamic": False},
                "input_activations": {"type": "float", "num_bits": 8, "strategy": "group",
                                      "group_size": cols, "dynamic": True},
            }},
            "ignore": ["lm_head"],
        }  # fmt: skip
    else:
        raise ValueError(f"layout must be fp8 or compressed-tensors, got {layout!r}")
    for directory, tensors, cfg in (
        (Path(target), quantized, raw),
        (Path(as_written) if as_written is not None else None, dequantized,
         {k: v for k, v in raw.items() if k != "quantization_config"}),
    ):  # fmt: skip
        if directory is None:
            continue
        directory.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(directory / "model.safetensors"))
        (directory / "config.json").write_text(json.dumps(cfg))
