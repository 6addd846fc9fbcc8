"""Runner V2's CUDA-graph pool, measured by capturing the real decode graphs once.

The runner's persistent buffers (request state table, input buffers, and the logits buffer all
graphs write into) are allocated for a probe KV cache of one full-length sequence (graph shapes
do not depend on the number of blocks, only on `max_model_len` and the batch sizes), then the
decode graphs for every batch size the run will capture are captured into one private pool, as
`initialize_kv_cache` does (with speculative decoding, also the verification graphs and the
draft model's proposal graphs, and the draft's share of every KV block). Everything is released afterwards; the run's own capture has the
same shapes and so the same pool size.
"""

from __future__ import annotations

from typing import Any

import torch

from davit_contract.graphs import graph_batch_sizes
from davit_engine.runner.v2.graphs import DecodeGraphs


def probe_v2_graphs(runner: Any) -> tuple[int, int, tuple[int, ...]]:
    """(runner buffer bytes, graph pool bytes, captured sizes) of a RunnerV2 on CUDA; the
    graphs' shared logits buffer counts as a runner buffer."""
    config = runner.config
    device = runner.device
    max_len = config.max_model_len or runner.model_config.max_position_embeddings
    probe_blocks = -(-max_len // config.block_size)
    use_graphs = runner.use_graphs
    runner.use_graphs = False  # allocate buffers only; the capture is measured on its own
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(device)
    try:
        runner.initialize_kv_cache(probe_blocks)
        sizes = graph_batch_sizes(config.max_num_seqs)
        graphs = DecodeGraphs(runner._graph_step, sizes, runner.model_config.vocab_size, device)
        # Speculative decoding's verification and draft-proposal graphs, when configured.
        spec_graphs = runner.make_spec_graphs()
        torch.cuda.synchronize(device)
        after_buffers = torch.cuda.memory_reserved(device)
        buffers = max(0, after_buffers - before - probe_blocks * runner.block_bytes)
        with torch.inference_mode():
            graphs.capture()
            for extra in spec_graphs:
                extra.capture()
        torch.cuda.synchronize(device)
        # The warm-up runs before each capture use the ordinary pool: drop them from the count.
        torch.cuda.empty_cache()
        pool = max(0, torch.cuda.memory_reserved(device) - after_buffers)
        del graphs, spec_graphs
    finally:
        runner.use_graphs = use_graphs
        runner.release_kv_cache()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    return int(buffers), int(pool), tuple(sizes)
