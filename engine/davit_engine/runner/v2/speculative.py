"""Runner V2's speculative decoding: a verification step's logits, drafts and verdicts.

A verifying row (`ScheduledRequest.num_spec_tokens` K) computes its last token and K draft
positions. Its drafts are in the state table after its last token before the forward runs:
n-gram drafts staged with the step's other changes, a draft model's proposed on the device
(`DraftModel.propose`), padding (never accepted) where a proposal is shorter than K. The target
computes logits at all K + 1 positions; `kernels.rejection.verify_drafts` keeps the accepted
drafts and draws the target's own token, which is written into the state table after them. The
host receives, per verifying row, the K + 1 tokens and the number accepted.

When every row of a step verifies (uniform K + 1 tokens per row), a captured graph runs the
input preparation, the forward (and the draft's mirror pass) and the logits of all positions,
padded to the next captured size; mixed steps (prefill chunks, rows that decode normally) run
eagerly. The verification itself runs on the stream after the replay, without host sync.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from davit_engine.core.batch import ScheduledRequest
from davit_engine.kernels.rejection import VerifyPolicy, VerifyRows, verify_drafts
from davit_engine.runner.v2.draft_model import DraftModel
from davit_engine.runner.v2.graphs import DecodeGraphs
from davit_engine.runner.v2.state import RequestStateTable, StepRows
from davit_engine.spec_decode.config import SpeculativeConfig, max_speculating_seqs

logger = logging.getLogger(__name__)


def verify_policy(config: SpeculativeConfig) -> VerifyPolicy:
    if config.rejection_sample_method == "fly":
        return VerifyPolicy(
            "fly",
            fly_window=config.fly_window_size or 1,
            fly_entropy_threshold=float(config.fly_entropy_threshold),
            fly_entropy_top_k=config.fly_entropy_top_k,
        )
    if config.rejection_sample_method == "synthetic":
        return VerifyPolicy(
            "synthetic",
            synthetic_rates=config.synthetic_acceptance_rates,
            synthetic_length=config.synthetic_acceptance_length,
        )
    return VerifyPolicy()


@dataclass
class Verdicts:
    """A verification's device results for S rows: tokens [S, K + 1] and accepted [S]."""

    tokens: torch.Tensor
    num_accepted: torch.Tensor


class SpecDecoder:
    """Configuration, buffers and graphs of runner V2's verification steps."""

    def __init__(
        self,
        config: SpeculativeConfig,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        draft: DraftModel | None,
    ) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_rows = max_speculating_seqs(max_num_seqs, max_num_batched_tokens, self.k)
        self.policy = verify_policy(config)
        self.draft = draft
        self.graphs: DecodeGraphs | None = None
        self.num_verify_steps = 0
        self.num_verify_graph_steps = 0

    def verify(
        self,
        logits: torch.Tensor,  # [S, K + 1, V] float32
        rows: StepRows,  # the step's rows
        spec_index: torch.Tensor,  # [S] int64: which rows verify
        spec_requests: list[ScheduledRequest],
        state: RequestStateTable,
    ) -> Verdicts:
        """Verify the rows' drafts and write each row's final token into the state table."""
        k = self.k
        device = logits.device
        slot = rows.slot[spec_index].long()
        last = rows.num_computed[spec_index].long()  # position of the last (fed) token
        assert rows.num_drafts is not None
        num_drafts = rows.num_drafts[spec_index].long()
        width = state.token_ids.shape[1]
        offsets = torch.arange(1, k + 1, device=device)
        draft_pos = (last[:, None] + offsets[None, :]).clamp(max=width - 1)
        draft = state.token_ids[slot[:, None], draft_pos].long()
        table = state.sampling
        verify_rows = VerifyRows(
            draft=draft,
            num_drafts=num_drafts,
            position=last + 1,
            temperature=table.temperature[slot],
            top_k=table.top_k[slot],
            top_p=table.top_p[slot],
            min_p=table.min_p[slot],
            seed=table.seed[slot].long(),
        )
        vocab = logits.shape[-1]
        any_random = any(not r.sampling.is_greedy for r in spec_requests)
        any_filtered = any(
            not r.sampling.is_greedy
            and (0 < r.sampling.top_k < vocab or r.sampling.top_p < 1.0 or r.sampling.min_p > 0)
            for r in spec_requests
        )
        tokens, num_accepted = verify_drafts(
            logits, verify_rows, self.policy, any_random=any_random, any_filtered=any_filtered
        )
        final = tokens.gather(1, num_accepted[:, None]).squeeze(1)
        final_pos = (last + 1 + num_accepted).clamp(max=width - 1)
        state.token_ids.view(-1).index_copy_(0, slot * width + final_pos, final.to(torch.int32))
        self.num_verify_steps += 1
        return Verdicts(tokens, num_accepted)
