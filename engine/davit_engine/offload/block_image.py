"""A KV block of every layer as one byte image, and the copies between images and the cache.

The runner's per-layer caches (`[2, num_blocks, block_size, Hkv, D]`, keys then values) are
views of one tensor `[num_layers, 2, num_blocks, block_size, Hkv, D]` (see
`runner.paged_kv.allocate_kv_caches`). Seen as bytes with the block axis first,
`[num_blocks, num_layers, 2, block_size, Hkv, D * element]`, block `b` of every layer is one
(strided) entry, so one `index_select` gathers any set of blocks into contiguous images and one
`index_copy_` scatters images back, whatever the number of layers. Bytes, not elements: the
copies are exact for every element type (FP8 included) and need no kernels per dtype.

A draft model that shares the target's block tables (speculative decoding) has its own cache;
its part of a block follows the target's in the image.
"""

from __future__ import annotations

import torch


def block_major(layer_caches: list[torch.Tensor]) -> torch.Tensor:
    """`[num_blocks, num_layers, 2, block_size, Hkv, D * element / w]` over the caches as
    integers of the widest width `w` (8, 4, 2 or 1 bytes) that divides a head's bytes: the
    copies move fewer, wider elements. The caches must be consecutive views of one tensor
    (ValueError otherwise)."""
    first = layer_caches[0]
    layer_bytes = first.numel() * first.element_size()
    for i, cache in enumerate(layer_caches):
        if (
            not cache.is_contiguous()
            or cache.shape != first.shape
            or cache.dtype != first.dtype
            or cache.data_ptr() != first.data_ptr() + i * layer_bytes
        ):
            raise ValueError("KV offload needs every layer's KV cache inside one tensor")
    head_bytes = first.shape[-1] * first.element_size()
    width = next(
        w
        for w in (torch.int64, torch.int32, torch.int16, torch.uint8)
        if head_bytes % w.itemsize == 0
    )
    raw = first.view(torch.uint8).view(width)  # [2, N, bs, Hkv, D * element / w]
    whole = raw.as_strided((len(layer_caches), *raw.shape), (raw.numel(), *raw.stride()))
    return whole.permute(2, 0, 1, 3, 4, 5)


class BlockImage:
    """The parts (model, then draft) of one block's image and the copies in and out of them."""

    def __init__(self, cache_groups: list[list[torch.Tensor]]) -> None:
        self.parts = [block_major(group) for group in cache_groups if group]
        self.part_bytes = [part[0].numel() * part.element_size() for part in self.parts]
        self.block_bytes = sum(self.part_bytes)
        self.num_blocks = self.parts[0].shape[0]
        self.device = self.parts[0].device
        # Shapes without the block count, for the identity.
        self.layouts = [
            tuple(group[0].shape[:1]) + tuple(group[0].shape[2:]) for group in cache_groups if group
        ]
        self.layer_counts = [len(group) for group in cache_groups if group]

    def part_offsets(self) -> list[tuple[int, int]]:
        offsets, start = [], 0
        for nbytes in self.part_bytes:
            offsets.append((start, start + nbytes))
            start += nbytes
        return offsets

    @staticmethod
    def _as_part(part: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
        """uint8 images `[n, part bytes]` (contiguous) seen in the part's element type and
        shape."""
        return images.view(part.dtype).view(images.shape[0], *part.shape[1:])

    def gather(self, block_ids: torch.Tensor, outs: list[torch.Tensor]) -> None:
        """Copy blocks `block_ids` [n] into `outs` (one contiguous `[>= n, part bytes]` uint8
        tensor per part), on the current stream."""
        n = block_ids.shape[0]
        with torch.inference_mode():
            for part, out in zip(self.parts, outs, strict=True):
                torch.index_select(part, 0, block_ids, out=self._as_part(part, out[:n]))

    def scatter(self, block_ids: torch.Tensor, srcs: list[torch.Tensor]) -> None:
        """Copy images `srcs` (per part `[>= n, part bytes]`) into blocks `block_ids` [n]."""
        n = block_ids.shape[0]
        with torch.inference_mode():
            for part, src in zip(self.parts, srcs, strict=True):
                part.index_copy_(0, block_ids, self._as_part(part, src[:n]))

    def copy_out(self, block_id: int, image: torch.Tensor) -> None:
        """Block `block_id` into one host image `[block bytes]` (synchronous; CPU caches)."""
        with torch.inference_mode():
            for part, (start, end) in zip(self.parts, self.part_offsets(), strict=True):
                self._as_part(part, image[None, start:end])[0].copy_(part[block_id])

    def copy_in(self, block_id: int, image: torch.Tensor) -> None:
        """One host image into block `block_id` (synchronous; CPU caches)."""
        with torch.inference_mode():
            for part, (start, end) in zip(self.parts, self.part_offsets(), strict=True):
                part[block_id].copy_(self._as_part(part, image[None, start:end])[0])
