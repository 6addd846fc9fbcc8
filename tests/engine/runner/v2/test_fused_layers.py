from __future__ import annotations

import pytest
import torch

from davit_engine.config import EngineConfig
from davit_engine.kernels.attention_backend import TritonPagedAttention
from davit_engine.layers.attention import AttentionBackend, AttentionMetadata, TorchPagedAttention
from davit_engine.loader import load_model
from davit_engine.runner.v2.fused_layers import install_fused_layers


def _prefill_meta(
    device: torch.device, num_tokens: int, num_blocks: int, backend: AttentionBackend
) -> AttentionMetadata:
    positions = torch.arange(num_tokens, device=device)
    return AttentionMetadata(
        slot_mapping=positions,
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
        backend=backend,
    )


@pytest.mark.parametrize("model", ["random:qwen3-tiny", "random:qwen2-tiny", "random:llama-tiny"])
@pytest.mark.parametrize("fused_backend", ["torch", "triton"])
def test_fused_layers_keep_the_model_output(
    device: torch.device, model: str, fused_backend: str
) -> None:
    """A prefill through the model with the fused kernels swapped in matches the plain model
    (fp32 tiny models: RMSNorm, residual add + norm, q/k norm, rotary, SiLU all fused). With the
    Triton backend the rotary kernel also writes the KV cache: the caches must match too."""
    config = EngineConfig(model=model, dtype="float32", device=device.type)
    plain = load_model(config, device).model
    fused = load_model(config, device).model
    fused.load_state_dict(plain.state_dict())
    num_swapped = install_fused_layers(fused)
    kinds = ("RMSNorm", "LlamaAttention", "LlamaMLP", "LlamaForCausalLM")
    assert num_swapped == len([m for m in fused.modules() if type(m).__name__ in kinds])
    num_tokens, page, num_blocks = 11, 4, 4
    ids = torch.randint(0, 512, (num_tokens,), device=device)
    outs, caches_out = [], []
    backends: list[AttentionBackend] = [
        TorchPagedAttention(),
        TorchPagedAttention() if fused_backend == "torch" else TritonPagedAttention(),
    ]
    for net, backend in zip((plain, fused), backends, strict=True):
        c = net.config
        caches = [
            torch.zeros(2, num_blocks, page, c.num_kv_heads, c.head_dim, device=device)
            for _ in range(c.num_layers)
        ]
        meta = _prefill_meta(device, num_tokens, num_blocks, backend)
        with torch.inference_mode():
            outs.append(
                net.compute_logits(net(ids, torch.arange(num_tokens, device=device), caches, meta))
            )
        caches_out.append(torch.stack(caches))
    assert torch.allclose(outs[0], outs[1], atol=1e-4, rtol=1e-4)
    assert torch.allclose(caches_out[0], caches_out[1], atol=1e-5, rtol=1e-5)


def test_unknown_model_composition_is_left_alone(device: torch.device) -> None:
    """A subclass of the model (another composition) keeps its own forward."""
    config = EngineConfig(model="random:qwen3-tiny", dtype="float32", device=device.type)
    model = load_model(config, device).model

    class Wrapped(type(model)):  # type: ignore[misc]
        pass

    model.__class__ = Wrapped
    install_fused_layers(model)
    assert "forward" not in vars(model)  # the model forward was not swapped
    assert all("forward" in vars(m) for m in model.modules() if type(m).__name__ == "RMSNorm")
