"""Repetition, presence and frequency penalties on a batch of logits, on the device.

Tensor operations over the request-state table's token rows (no kernel of our own: a scatter-add
of token counts and two elementwise passes), applied only on steps where a request asks for a
penalty. Nothing here synchronises with the host.
"""

from __future__ import annotations

import torch


def apply_penalties(
    logits: torch.Tensor,  # [B, V] float32, changed in place
    token_table: torch.Tensor,  # [S, max_model_len] int32
    row_slot: torch.Tensor,  # [B] int32
    seq_lens: torch.Tensor,  # [B] int32: tokens before the one being drawn
    prompt_lens: torch.Tensor,  # [B] int32
    repetition: torch.Tensor,  # [B] float32, 1 = off
    presence: torch.Tensor,  # [B] float32, 0 = off
    frequency: torch.Tensor,  # [B] float32, 0 = off
    max_seq_len: int,
) -> None:
    """Repetition penalty over prompt and output tokens; presence and frequency penalties over
    output tokens (OpenAI's definitions). Tensor ops on the device, no host synchronisation."""
    num_rows, vocab_size = logits.shape
    pos = torch.arange(max_seq_len, device=logits.device)
    tokens = token_table[row_slot.long(), :max_seq_len].long().clamp(0, vocab_size - 1)
    seen_mask = pos[None, :] < seq_lens[:, None]
    out_mask = seen_mask & (pos[None, :] >= prompt_lens[:, None])
    counts = torch.zeros(num_rows, vocab_size, device=logits.device)
    counts.scatter_add_(1, tokens, out_mask.float())
    seen = torch.zeros(num_rows, vocab_size, device=logits.device)
    seen.scatter_add_(1, tokens, seen_mask.float())
    rep = repetition[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits.copy_(torch.where(seen > 0, penalised, logits))
    logits -= frequency[:, None] * counts + presence[:, None] * (counts > 0).float()
