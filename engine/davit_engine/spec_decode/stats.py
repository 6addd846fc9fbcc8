"""Acceptance counters of speculative decoding, named after upstream's metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Totals since startup.

    - `num_drafts`: verification steps of requests that had at least one draft token;
    - `num_draft_tokens`: draft tokens proposed (padding the target computed is not counted);
    - `num_accepted_tokens`: draft tokens accepted (the target's own token each step is not);
    - `accepted_per_position[i]`: steps whose draft at position i (0-based) was accepted.
    """

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_speculative_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One request's verification step."""
        if num_draft_tokens <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification step with drafts (accepted + the target's own)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
