"""The identity a stored KV block belongs to: what its bytes depend on besides its tokens.

A block's key in the lower tiers is the prefix cache's chained token hash; the tiers of one
engine hold blocks of one identity only, and the disk tier keeps each identity in its own
folder and in every file's header. Two engines share stored blocks exactly when their
identities are equal, so a block written by another model, revision, dtype, KV layout or KV
quantization is never read as ours.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

import davit_engine
from davit_engine.config import EngineConfig

# Bumped when the bytes of a stored block change meaning (layout of the block image, header).
FORMAT_VERSION = 1
# Elements of each parameter fed to the weights fingerprint: enough to tell two checkpoints
# (or two random seeds) apart, cheap to read at startup.
_FINGERPRINT_ELEMENTS = 4096


def weights_fingerprint(models: list[torch.nn.Module]) -> str:
    """A digest of the first elements of every parameter and of the FP8 KV scales.

    The model's name and revision may stay the same while the files behind them change (a
    local directory rewritten, another seed for random weights); the K/V of a block follow
    the weights, so their fingerprint is part of the identity.
    """
    h = hashlib.blake2b(digest_size=16)
    with torch.no_grad():
        for model in models:
            for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
                h.update(name.encode())
                flat = param.detach().reshape(-1)[:_FINGERPRINT_ELEMENTS]
                h.update(flat.to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
            # FP8 KV scales: buffers, not parameters, and the cache's bytes are scaled by them.
            for module in model.modules():
                scale = getattr(module, "kv_scale", None)
                if isinstance(scale, torch.Tensor):
                    h.update(scale.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def kv_identity(
    config: EngineConfig,
    models: list[torch.nn.Module],
    device: torch.device,
    dtype: torch.dtype,
    kv_cache_dtype: str,
    layouts: list[tuple[int, ...]],
    kv_dtype: torch.dtype,
) -> dict[str, Any]:
    """Everything a block's bytes depend on. `models` and `layouts`: the model, then a draft
    model sharing its block tables; a layout is a KV tensor's shape without the block count
    (`[num_layers, 2, block_size, num_kv_heads, head_dim]`)."""
    return {
        "format": FORMAT_VERSION,
        "engine": davit_engine.__version__,
        "model": config.model,
        "revision": config.revision or "",
        "seed": config.seed if config.model.startswith("random:") else None,
        "weights": weights_fingerprint(models),
        "dtype": str(dtype).removeprefix("torch."),
        "kv_cache_dtype": kv_cache_dtype,
        "kv_element": str(kv_dtype).removeprefix("torch."),
        "block_size": config.block_size,
        "layout": [list(shape) for shape in layouts],
        "device": device.type,
    }


def identity_digest(identity: dict[str, Any]) -> bytes:
    """16 bytes naming the identity (sorted JSON, BLAKE2b)."""
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=16).digest()
