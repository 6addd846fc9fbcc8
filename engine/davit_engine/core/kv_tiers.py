"""What the scheduler needs from the KV tiers below the GPU prefix cache (host memory, disk).

The scheduler and the block manager decide which GPU blocks are stored below and which are
loaded back, and when a request whose prefix continues below may run; the implementation
(`davit_engine.offload`) moves the bytes and keeps its own indexes. Plain data crosses this
interface: block hashes (the prefix cache's chained hashes), GPU block ids and load ids.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence


class LowerTiers(abc.ABC):
    """The tiers below the GPU prefix cache, as the engine loop's thread sees them.

    Every method is called from the engine loop only, between steps. Contract:
    - `store(h, b)` is called when GPU block `b` was registered full under hash `h`; the tiers
      copy it when they like, but their copy must read the block before any step that reuses
      it runs. The block manager calls `block_reused(b)` when it hands a registered block out
      for other tokens; the copy is then due before the next step is launched.
    - `load(...)` copies stored blocks into GPU blocks the scheduler allocated; those blocks
      stay untouched (not scheduled, not freed) until `finished_loads()` reports the load.
      A block that cannot be read intact (corrupt, truncated, foreign, an I/O error) ends the
      load's valid prefix there: the scheduler computes the rest, so a damaged tier costs
      time, never wrong tokens.
    """

    @abc.abstractmethod
    def contains(self, block_hash: bytes) -> bool:
        """Whether some tier holds the block (a hint: loading it may still fail)."""

    @abc.abstractmethod
    def store(self, block_hash: bytes, block_id: int) -> None:
        """Queue a copy of GPU block `block_id`, just registered full under `block_hash`."""

    @abc.abstractmethod
    def block_reused(self, block_id: int) -> None:
        """GPU block `block_id`, registered before, now holds other tokens from the next step
        on: a queued copy of it must be taken before that step runs."""

    @abc.abstractmethod
    def load(self, load_id: int, block_hashes: Sequence[bytes], block_ids: Sequence[int]) -> int:
        """Start copying the blocks stored under `block_hashes` (consecutive blocks of one
        prefix, in order) into GPU blocks `block_ids`; returns how many, from the first, are
        on their way (0: nothing started and no completion will be reported). A queued copy of
        one of `block_ids` (its previous contents) is taken before the load writes it."""

    @abc.abstractmethod
    def finished_loads(self) -> list[tuple[int, int]]:
        """Loads that ended since the last call: (load id, blocks that arrived intact,
        counted from the first of that load)."""

    @abc.abstractmethod
    def wait(self, timeout_s: float) -> None:
        """Block for up to `timeout_s` or until some load may have finished (an idle engine
        loop waits here instead of spinning)."""

    def discard_stores(self) -> None:  # noqa: B027 - optional: tiers without a queue
        """Drop the queued copies (the prefix cache was reset: its blocks are stale)."""
