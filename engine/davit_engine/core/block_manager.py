"""The paged KV cache's bookkeeping: a fixed pool of blocks, reference counts and a prefix cache.

The runner owns the KV tensors; this module only decides which block ids hold which tokens.

Prefix caching: every FULL block whose K/V have been computed is registered under a chained
hash (the hash of its parent block's hash and its own token ids), so a later request whose
token ids start with the same full blocks reuses them instead of recomputing them. A cached
block whose reference count drops to zero is not wiped: it joins an LRU of evictable blocks and
is reused for other tokens only when no never-cached free block is left.

Lower tiers (`core.kv_tiers.LowerTiers`, optional): every block registered in the prefix cache
is also handed to them (write-through), and a registered block about to be reused is announced
so that its copy is taken first. `match_lower_tiers` finds how far a prompt's prefix continues
below the GPU cache.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence

from davit_engine.core.kv_tiers import LowerTiers
from davit_engine.core.request import Request

# Token ids are non-negative and far below 2**63: 8-byte signed items encode every one exactly.
_TOKEN_TYPECODE = "q"


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """The chained hash of one full block: depends on the whole prefix, not just this block.

    BLAKE2b with a 16-byte digest: a cryptographic hash, so different prefixes do not collide
    in practice (unlike Python's `hash`, which an adversarial prompt could collide), and fast
    enough that hashing a block costs about a microsecond.
    """
    h = hashlib.blake2b(digest_size=16)
    if parent_hash is not None:
        h.update(parent_hash)
    h.update(array(_TOKEN_TYPECODE, token_ids).tobytes())
    return h.digest()


class BlockManager:
    """Allocates KV blocks of `block_size` tokens to requests from a pool of `num_blocks`.

    A block is in exactly one of three states: referenced (ref count > 0, in some request's
    block table), evictable (ref count 0, still registered in the prefix cache, in LRU order),
    or free (ref count 0, holding nothing reusable). Requests never write into a shared block:
    prefix hits cover whole blocks only and every token after them goes into fresh blocks.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        tiers: LowerTiers | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Offload tiers see only registered blocks: without prefix caching there are none.
        self.tiers = tiers if enable_prefix_caching else None
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._hash_to_block: dict[bytes, int] = {}
        self._free: deque[int] = deque(range(num_blocks))
        # Least recently released first: the next block to evict is at the front.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.prefix_cache_queries = 0  # tokens looked up in the prefix cache at admission
        self.prefix_cache_hits = 0  # of those, tokens found in the cache

    # ---- capacity -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks available to allocation: never-cached free blocks plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, referenced or not."""
        return len(self._hash_to_block)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, 0..1 (evictable cached blocks count as free)."""
        return self.num_used_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    # ---- prefix cache ---------------------------------------------------------------------

    def match_prefix(self, req: Request) -> list[int]:
        """Block ids of the longest cached prefix of `req.token_ids`, in order.

        Never covers the request's last token: the runner must compute at least one token to
        produce logits. Takes no references; pass the result to `can_allocate`/`allocate`.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (len(req.token_ids) - 1) // self.block_size
        hashes = req.block_hashes
        matched: list[int] = []
        for i in range(max_blocks):
            if i == len(hashes):
                # Hash lazily and only as far as the cache matches: a miss ends the walk anyway.
                self._extend_hashes(req, i + 1)
            block_id = self._hash_to_block.get(hashes[i])
            if block_id is None:
                break
            matched.append(block_id)
        return matched

    def cached_block_id(self, block_hash: bytes) -> int | None:
        """The block that holds `block_hash` in the prefix cache, None when none does."""
        return self._hash_to_block.get(block_hash)

    def match_lower_tiers(self, req: Request, num_gpu_blocks: int) -> list[bytes]:
        """Hashes of the blocks after the first `num_gpu_blocks` (a GPU prefix match) that the
        lower tiers hold, as far as they continue the prefix; never the request's last token's
        block (see `match_prefix`). Empty without lower tiers."""
        tiers = self.tiers
        if tiers is None:
            return []
        max_blocks = (len(req.token_ids) - 1) // self.block_size
        hashes = req.block_hashes
        found: list[bytes] = []
        for i in range(num_gpu_blocks, max_blocks):
            if i == len(hashes):
                self._extend_hashes(req, i + 1)
            if not tiers.contains(hashes[i]):
                break
            found.append(hashes[i])
        return found

    def _extend_hashes(self, req: Request, num_full_blocks: int) -> None:
        hashes = req.block_hashes
        bs = self.block_size
        tokens = req.token_ids
        for i in range(len(hashes), num_full_blocks):
            parent = hashes[i - 1] if i else None
            hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs]))

    def cache_full_blocks(self, req: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that are full of computed tokens in the prefix cache.

        Call only after the K/V of tokens `[0, num_computed_tokens)` are really written: a
        registered block may be handed to another request in the very next step. A block whose
        hash is already registered (another request computed the same prefix concurrently) is
        left unregistered and simply becomes free when released.
        """
        if not self.enable_prefix_caching:
            return
        num_full = min(num_computed_tokens // self.block_size, len(req.block_ids))
        start = req.num_registered_blocks
        if num_full <= start:
            return
        self._extend_hashes(req, num_full)
        hashes = req.block_hashes
        tiers = self.tiers
        for i in range(start, num_full):
            block_hash = hashes[i]
            if block_hash not in self._hash_to_block:
                block_id = req.block_ids[i]
                self._hash_to_block[block_hash] = block_id
                self._block_hash[block_id] = block_hash
                if tiers is not None:
                    tiers.store(block_hash, block_id)
        req.num_registered_blocks = num_full

    # ---- allocation -----------------------------------------------------------------------

    def can_allocate(self, cached_block_ids: list[int], num_tokens: int, reserve: int = 0) -> bool:
        """Whether a request with no blocks can take `cached_block_ids` and grow to `num_tokens`,
        leaving at least `reserve` blocks free afterwards."""
        num_new = self.num_blocks_for(num_tokens) - len(cached_block_ids)
        # Reviving an evictable hit takes it out of the allocatable pool.
        num_revived = sum(1 for b in cached_block_ids if self._ref_counts[b] == 0)
        return num_new + reserve <= self.num_free_blocks - num_revived

    def allocate(
        self,
        req: Request,
        cached_block_ids: list[int],
        num_tokens: int,
        count_lookup: bool = True,
    ) -> None:
        """Give `req` (which holds no blocks) the prefix hits plus fresh blocks for `num_tokens`.

        Counts the lookup in the prefix-cache counters unless `count_lookup` is False (a
        request admitted again right after its blocks were loaded from a lower tier: its
        lookup was counted when the load started). Raises RuntimeError when the blocks are not
        there: callers check `can_allocate` first.
        """
        if req.block_ids:
            raise RuntimeError(f"{req.request_id} already holds blocks")
        if not self.can_allocate(cached_block_ids, num_tokens):
            raise RuntimeError(f"not enough free KV blocks for {req.request_id}")
        refs = self._ref_counts
        for block_id in cached_block_ids:
            if refs[block_id] == 0:
                del self._evictable[block_id]
            refs[block_id] += 1
        block_ids = list(cached_block_ids)
        for _ in range(self.num_blocks_for(num_tokens) - len(block_ids)):
            block_ids.append(self._take_free_block())
        req.block_ids = block_ids
        req.num_registered_blocks = len(cached_block_ids)
        if self.enable_prefix_caching and count_lookup:
            self.prefix_cache_queries += len(req.token_ids)
            self.prefix_cache_hits += len(cached_block_ids) * self.block_size

    def can_append_slots(self, req: Request, num_tokens: int) -> bool:
        """Whether `req`'s block table can grow to cover `num_tokens` tokens."""
        return self.num_blocks_for(num_tokens) - len(req.block_ids) <= self.num_free_blocks

    def append_slots(self, req: Request, num_tokens: int) -> None:
        """Grow `req`'s block table in place to cover `num_tokens` tokens (decode or next chunk).

        In place because the runner may hold the same list; raises RuntimeError when the blocks
        are not there (callers check `can_append_slots` and preempt first).
        """
        num_new = self.num_blocks_for(num_tokens) - len(req.block_ids)
        if num_new <= 0:
            return
        if num_new > self.num_free_blocks:
            raise RuntimeError(f"not enough free KV blocks to grow {req.request_id}")
        for _ in range(num_new):
            req.block_ids.append(self._take_free_block())

    def free(self, req: Request) -> None:
        """Release all of `req`'s blocks; cached ones stay reusable until evicted."""
        refs = self._ref_counts
        # Release the tail first so that, under eviction, a prefix's deepest blocks go before
        # its root (a root evicted first would leave its descendants unreachable).
        for block_id in reversed(req.block_ids):
            refs[block_id] -= 1
            if refs[block_id] == 0:
                if self._block_hash[block_id] is not None:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)
        # A new list, not clear(): a runner may still read the old table of the step in flight.
        req.block_ids = []
        req.num_registered_blocks = 0

    def reset_prefix_cache(self) -> int:
        """Forget every evictable cached block (e.g. after new weights); returns how many."""
        num = len(self._evictable)
        if self.tiers is not None:
            self.tiers.discard_stores()
        while self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            self._uncache(block_id)
            self._free.append(block_id)
        return num

    def _take_free_block(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)
            if self.tiers is not None:
                self.tiers.block_reused(block_id)
            self._uncache(block_id)
        self._ref_counts[block_id] = 1
        return block_id

    def _uncache(self, block_id: int) -> None:
        block_hash = self._block_hash[block_id]
        if block_hash is not None:
            del self._hash_to_block[block_hash]
            self._block_hash[block_id] = None

    def check_invariants(self, live_requests: Sequence[Request]) -> None:
        """Verify the bookkeeping against the live requests' block tables (for tests; O(n))."""
        expected = [0] * self.num_blocks
        for req in live_requests:
            for block_id in req.block_ids:
                expected[block_id] += 1
        if expected != self._ref_counts:
            raise AssertionError("reference counts disagree with the live block tables")
        free, evictable = set(self._free), set(self._evictable)
        if len(free) != len(self._free) or free & evictable:
            raise AssertionError("a block is listed twice among free and evictable blocks")
        for block_id in range(self.num_blocks):
            is_idle = block_id in free or block_id in evictable
            if is_idle != (self._ref_counts[block_id] == 0):
                raise AssertionError(f"block {block_id} is idle and referenced, or neither")
            if block_id in free and self._block_hash[block_id] is not None:
                raise AssertionError(f"free block {block_id} is still registered in the cache")
            if block_id in evictable and self._block_hash[block_id] is None:
                raise AssertionError(f"evictable block {block_id} is not registered in the cache")
        for block_hash, block_id in self._hash_to_block.items():
            if self._block_hash[block_id] != block_hash:
                raise AssertionError(f"hash table entry for block {block_id} is stale")
