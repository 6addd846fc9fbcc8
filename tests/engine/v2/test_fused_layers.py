from __future__ import annotations

import torch

from davit_engine.config import EngineConfig
from davit_engine.layers.attention import AttentionMetadata, TorchPagedAttention
from davit_engine.loader import load_model
from davit_engine.runner.v2.fused_layers import install_fused_layers


def test_fused_layers_keep_the_model_output(device: torch.device) -> None:
    """A prefill through the model with the fused kernels swapped in matches the plain model
    (fp32, tiny Qwen3: RMSNorm, q/k norm, rotary and SiLU all on the fused path)."""
    config = EngineConfig(model="random:qwen3-tiny", dtype="float32", device=device.type)
    plain = load_model(config, device).model
    fused = load_model(config, device).model
    # every RMSNorm (2 per layer + final), attention block and MLP; q/k norms are inside
    # the fused attention but are RMSNorm modules too
    assert install_fused_layers(fused) == len(
        [
            m
            for m in fused.modules()
            if type(m).__name__ in ("RMSNorm", "LlamaAttention", "LlamaMLP")
        ]
    )
    num_tokens, page = 11, 4
    num_blocks = 4
    positions = torch.arange(num_tokens, device=device)
    meta = AttentionMetadata(
        slot_mapping=positions,
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
        backend=TorchPagedAttention(),
    )
    ids = torch.randint(0, 512, (num_tokens,), device=device)
    outs = []
    for model in (plain, fused):
        c = model.config
        caches = [
            torch.zeros(2, num_blocks, page, c.num_kv_heads, c.head_dim, device=device)
            for _ in range(c.num_layers)
        ]
        with torch.inference_mode():
            outs.append(model.compute_logits(model(ids, positions, caches, meta)))
    assert torch.allclose(outs[0], outs[1], atol=1e-5, rtol=1e-4)
