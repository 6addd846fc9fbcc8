"""The engine's flag defaults: the engine's parser and config take them from here, and the
operator plans with them when a spec leaves the limit unset, so the two cannot drift."""

from __future__ import annotations

BLOCK_SIZE = 16
BLOCK_SIZES = (8, 16, 32, 64, 128)
MAX_NUM_SEQS = 256
MAX_NUM_BATCHED_TOKENS = 2048
GPU_MEMORY_UTILIZATION = 0.9
