"""Block images: one gather or scatter moves a block of every layer, byte-exact for every
KV element type, between the runner's per-layer caches and contiguous images."""

from __future__ import annotations

import pytest
import torch

from davit_engine.offload.block_image import BlockImage
from davit_engine.runner.paged_kv import allocate_kv_caches
from davit_engine.shapes import get_shape


def filled_caches(dtype: torch.dtype, num_blocks: int = 12) -> list[torch.Tensor]:
    caches = allocate_kv_caches(get_shape("qwen3-tiny"), num_blocks, 16, dtype, torch.device("cpu"))
    generator = torch.Generator().manual_seed(3)
    for cache in caches:
        raw = cache.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))
    return caches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_gather_and_scatter_move_every_layer(dtype: torch.dtype) -> None:
    caches = filled_caches(dtype)
    image = BlockImage([caches])
    c = get_shape("qwen3-tiny")
    element = torch.empty((), dtype=dtype).element_size()
    assert image.block_bytes == c.num_layers * 2 * 16 * c.num_kv_heads * c.head_dim * element
    ids = torch.tensor([7, 2, 9])
    staged = [torch.empty(4, image.block_bytes, dtype=torch.uint8)]
    image.gather(ids, staged)
    for row, block in enumerate(ids.tolist()):
        single = torch.empty(image.block_bytes, dtype=torch.uint8)
        image.copy_out(block, single)
        assert torch.equal(staged[0][row], single)
        # The image is every layer's keys and values of that block, in layer order.
        expected = torch.cat([cache[:, block].reshape(-1).view(torch.uint8) for cache in caches])
        assert torch.equal(single, expected)
    before = [cache.clone() for cache in caches]
    image.scatter(torch.tensor([0, 1, 3]), staged)
    for cache, old in zip(caches, before, strict=True):
        for dst, src in ((0, 7), (1, 2), (3, 9)):
            assert torch.equal(cache[:, dst].view(torch.uint8), old[:, src].view(torch.uint8))
        untouched = [4, 5, 6, 7, 8, 9, 10, 11, 2]
        assert torch.equal(
            cache[:, untouched].view(torch.uint8), old[:, untouched].view(torch.uint8)
        )


def test_a_draft_models_part_follows_the_targets() -> None:
    target, draft = filled_caches(torch.float32), filled_caches(torch.bfloat16)
    image = BlockImage([target, draft])
    assert image.part_bytes == [target[0][:, 0].numel() * 2 * 4, draft[0][:, 0].numel() * 2 * 2]
    single = torch.empty(image.block_bytes, dtype=torch.uint8)
    image.copy_out(5, single)
    image.copy_in(6, single)
    for caches in (target, draft):
        for cache in caches:
            assert torch.equal(cache[:, 5].view(torch.uint8), cache[:, 6].view(torch.uint8))


def test_caches_in_separate_tensors_are_refused() -> None:
    separate = [torch.zeros(2, 4, 16, 2, 32) for _ in range(2)]
    with pytest.raises(ValueError, match="one tensor"):
        BlockImage([separate])
