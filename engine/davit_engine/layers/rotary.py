"""Rotary position embeddings (the "rotate half" layout), with Llama 3 frequency scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from davit_engine.types import ParamError


def rope_inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, after the checkpoint's rope scaling."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim)
    )
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "llama3":
        assert scaling is not None
        try:
            factor = float(scaling["factor"])
            low = float(scaling["low_freq_factor"])
            high = float(scaling["high_freq_factor"])
            old_len = float(scaling["original_max_position_embeddings"])
        except KeyError as exc:
            raise ParamError("model", f"rope_scaling (llama3) is missing {exc.args[0]!r}") from exc
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed down by `factor`, short ones kept, the band between blended.
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, blended, scaled)
    if rope_type == "freq_factors":
        # GGUF files carry Llama 3 scaling as per-frequency divisors (the rope_freqs tensor).
        assert scaling is not None
        factors = torch.tensor(scaling["factors"], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ParamError(
                "model",
                f"rope frequency factors have {factors.numel()} entries, expected {inv_freq.numel()}",
            )
        return inv_freq / factors
    raise ParamError(
        "model",
        f"rope_scaling type {rope_type!r} is not supported (supported: default, llama3, "
        "freq_factors)",
    )


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k given absolute positions; cos/sin tables are built once."""

    cos_table: torch.Tensor  # [max_positions, head_dim] float32
    sin_table: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        self.register_buffer("cos_table", torch.empty(0), persistent=False)
        self.register_buffer("sin_table", torch.empty(0), persistent=False)
        self.build_tables()

    def build_tables(self, device: torch.device | None = None) -> None:
        """(Re)compute the cos/sin tables in float32, e.g. after `Module.to_empty()`."""
        inv_freq = rope_inverse_frequencies(self.head_dim, self.theta, self.scaling)
        positions = torch.arange(self.max_positions, dtype=torch.int64).to(torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        target = device if device is not None else self.cos_table.device
        self.cos_table = emb.cos().to(target)
        self.sin_table = emb.sin().to(target)

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D] for `positions` [T], once per step and shared by every layer."""
        cos = self.cos_table[positions].unsqueeze(1).to(dtype)
        sin = self.sin_table[positions].unsqueeze(1).to(dtype)
        return cos, sin

    @staticmethod
    def rotate(
        rope: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, Hq, D]; k: [T, Hkv, D]; rope: (cos, sin) [T, 1, D]
        cos, sin = rope
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
