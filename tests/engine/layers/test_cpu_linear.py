"""oneDNN pre-packed linears compute what nn.Linear computes (bf16 on the CPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from davit_engine.layers.cpu_linear import PrepackedLinear, can_prepack, prepack_linears
from davit_engine.loader import build_empty
from davit_engine.loader.random_weights import fill_random
from davit_engine.shapes import SHAPES

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(
    not can_prepack(torch.bfloat16, CPU), reason="oneDNN bf16 is not available on this CPU"
)


@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_prepacked_linear_matches_nn_linear(rows: int) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 40, bias=True).to(torch.bfloat16)
    packed = PrepackedLinear(linear, batch_hint=16)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = linear(x).float()
        got = packed(x).float()
        # Leading dimensions are kept: [2, rows, in] -> [2, rows, out].
        assert packed(torch.stack([x, x])).shape == (2, rows, 40)
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


def test_whole_model_logits_stay_close() -> None:
    from davit_engine.layers.attention import AttentionMetadata, TorchPagedAttention

    config = SHAPES["qwen3-tiny"]
    model = build_empty(config, torch.bfloat16, CPU)
    fill_random(model, seed=1)
    tokens = torch.randint(0, config.vocab_size, (12,), generator=torch.Generator().manual_seed(2))

    def logits() -> torch.Tensor:
        kv = [
            torch.zeros(2, 1, 16, config.num_kv_heads, config.head_dim, dtype=torch.bfloat16)
            for _ in range(config.num_layers)
        ]
        meta = AttentionMetadata(
            slot_mapping=torch.arange(12),
            query_start_loc=torch.tensor([0, 12], dtype=torch.int32),
            seq_lens=torch.tensor([12], dtype=torch.int32),
            block_tables=torch.zeros(1, 1, dtype=torch.int32),
            max_query_len=12,
            max_seq_len=12,
            backend=TorchPagedAttention(),
        )
        with torch.inference_mode():
            return model.compute_logits(model(tokens, torch.arange(12), kv, meta))

    plain = logits()
    # qkv, o, gate_up and down in every layer, plus the head.
    assert prepack_linears(model, batch_hint=8) == 4 * config.num_layers + 1
    packed = logits()
    torch.testing.assert_close(packed, plain, rtol=0.05, atol=0.05)
