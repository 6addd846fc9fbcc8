"""Runner V2's decode CUDA graphs, as numbers: which batch sizes are captured and about how
much memory they take. The runner captures these sizes; the operator's memory plan uses the
estimate before any profile exists."""

from __future__ import annotations


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 128, then every 16: padding stays under ~12%."""
    sizes = [1, 2, 4, 8]
    sizes += list(range(16, 129, 8))
    sizes += list(range(144, max_num_seqs + 1, 16))
    sizes = [s for s in sizes if s <= max_num_seqs]
    if not sizes or sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def graph_logits_bytes(max_num_seqs: int, vocab_size: int) -> int:
    """The float32 logits buffer `[max_num_seqs, vocab]` that every decode graph writes,
    allocated once beside the graph pool."""
    return max_num_seqs * vocab_size * 4


def cuda_graph_estimate(
    max_num_seqs: int,
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    dtype_bytes: int,
) -> int:
    """The shared logits buffer plus one pool that holds about the largest graph's
    intermediates (its logits in the model dtype before the conversion, and the hidden- and
    intermediate-sized activations): graphs are captured largest first and reuse that pool."""
    largest = max_num_seqs * (vocab_size + 4 * hidden_size + 2 * intermediate_size)
    return graph_logits_bytes(max_num_seqs, vocab_size) + largest * dtype_bytes
