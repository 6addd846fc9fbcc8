"""Block pool bookkeeping and the hash-based prefix cache."""

from __future__ import annotations

import pytest

from davit_engine.core.block_manager import BlockManager, hash_block_tokens
from davit_engine.core.request import Request
from davit_engine.types import SamplingParams

BS = 4


def req(name: str, tokens: list[int]) -> Request:
    return Request(name, tokens, SamplingParams())


def admit(bm: BlockManager, r: Request, num_tokens: int | None = None) -> list[int]:
    """Admit `r` with its prefix hits, computing (and caching) all its tokens."""
    hits = bm.match_prefix(r)
    total = r.num_tokens if num_tokens is None else num_tokens
    assert bm.can_allocate(hits, total)
    bm.allocate(r, hits, total)
    bm.cache_full_blocks(r, total)
    return hits


def test_allocate_and_free_track_reference_counts() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = req("a", list(range(10)))  # 3 blocks
    admit(bm, a)
    assert len(a.block_ids) == 3 and len(set(a.block_ids)) == 3
    assert all(bm.ref_count(b) == 1 for b in a.block_ids)
    assert (bm.num_free_blocks, bm.num_used_blocks, bm.usage) == (5, 3, 3 / 8)
    bm.free(a)
    assert a.block_ids == []
    assert bm.num_free_blocks == 8 and bm.usage == 0.0
    bm.check_invariants([])


def test_append_slots_grows_only_at_block_boundaries() -> None:
    bm = BlockManager(8, BS)
    a = req("a", [1, 2, 3])
    admit(bm, a)
    table = a.block_ids
    assert len(table) == 1
    bm.append_slots(a, 4)
    assert len(a.block_ids) == 1
    bm.append_slots(a, 5)
    assert len(a.block_ids) == 2
    assert a.block_ids is table, "the block table must grow in place"
    bm.check_invariants([a])


def test_cannot_allocate_beyond_the_pool() -> None:
    bm = BlockManager(2, BS)
    a = req("a", list(range(9)))  # needs 3 blocks
    assert not bm.can_allocate([], 9)
    with pytest.raises(RuntimeError):
        bm.allocate(a, [], 9)
    assert bm.num_free_blocks == 2
    b = req("b", list(range(8)))
    admit(bm, b)
    assert not bm.can_append_slots(b, 9)
    with pytest.raises(RuntimeError):
        bm.append_slots(b, 9)


def test_shared_prefix_hits_whole_blocks_and_shares_them() -> None:
    bm = BlockManager(16, BS)
    prefix = list(range(100, 108))  # two full blocks
    a = req("a", [*prefix, 1, 2, 3])
    assert admit(bm, a) == []
    b = req("b", [*prefix, 9, 9])
    hits = admit(bm, b)
    assert hits == a.block_ids[:2]
    assert b.block_ids[:2] == a.block_ids[:2]
    assert b.block_ids[2] != a.block_ids[2]
    assert [bm.ref_count(x) for x in hits] == [2, 2]
    assert bm.prefix_cache_queries == 11 + 10
    assert bm.prefix_cache_hits == 8
    bm.check_invariants([a, b])


def test_no_hit_for_the_same_block_under_a_different_prefix() -> None:
    bm = BlockManager(16, BS)
    a = req("a", [1, 1, 1, 1, 7, 7, 7, 7, 0])
    admit(bm, a)
    # Second block has the same tokens as a's second block, but its parent block differs.
    b = req("b", [2, 2, 2, 2, 7, 7, 7, 7, 0])
    assert bm.match_prefix(b) == []
    c = req("c", [1, 1, 1, 1, 7, 7, 7, 8, 0])
    assert bm.match_prefix(c) == a.block_ids[:1]
    assert hash_block_tokens(None, [7, 7, 7, 7]) != hash_block_tokens(
        hash_block_tokens(None, [1, 1, 1, 1]), [7, 7, 7, 7]
    )


def test_hash_is_stable_and_order_sensitive() -> None:
    h = hash_block_tokens(None, [1, 2, 3, 4])
    assert h == hash_block_tokens(None, (1, 2, 3, 4))
    assert h != hash_block_tokens(None, [4, 3, 2, 1])
    assert h != hash_block_tokens(None, [1, 2, 3, 4 + (1 << 32)])
    assert len(h) == 16


def test_match_never_covers_the_last_token() -> None:
    bm = BlockManager(16, BS)
    a = req("a", list(range(8)))
    admit(bm, a)
    assert bm.num_cached_blocks == 2
    same = req("same", list(range(8)))
    # Both blocks are cached, but the last token must be computed to get logits.
    assert bm.match_prefix(same) == a.block_ids[:1]
    longer = req("longer", list(range(9)))
    assert bm.match_prefix(longer) == a.block_ids[:2]


def test_only_full_computed_blocks_are_cached() -> None:
    bm = BlockManager(16, BS)
    a = req("a", list(range(10)))
    bm.allocate(a, [], 10)
    bm.cache_full_blocks(a, 5)  # one full block computed so far
    assert bm.num_cached_blocks == 1
    bm.cache_full_blocks(a, 10)
    assert bm.num_cached_blocks == 2  # the third block holds only 2 tokens
    a.token_ids.extend([10, 11])  # decode fills the third block
    bm.cache_full_blocks(a, 12)
    assert bm.num_cached_blocks == 3
    probe = req("probe", [*range(12), 99])
    assert bm.match_prefix(probe) == a.block_ids


def test_freed_cached_blocks_stay_reusable_until_evicted() -> None:
    bm = BlockManager(4, BS)
    a = req("a", list(range(9)))  # 2 full blocks + 1 partial
    admit(bm, a)
    cached = a.block_ids[:2]
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.usage == 0.0
    b = req("b", [*range(8), 50])
    assert admit(bm, b) == cached
    bm.check_invariants([b])


def test_eviction_takes_free_blocks_first_then_lru_unreferenced() -> None:
    bm = BlockManager(6, BS)
    a = req("a", [*range(8), 1])  # blocks A0 A1 cached, A2 partial
    admit(bm, a)
    b = req("b", [*range(20, 28), 1])  # blocks B0 B1 cached, B2 partial
    admit(bm, b)
    a_cached, b_cached = a.block_ids[:2], b.block_ids[:2]
    bm.free(a)  # released first: a's blocks are least recently used
    bm.free(b)
    bm.check_invariants([])
    # Two never-cached free blocks exist (a's and b's partial blocks): use them before evicting.
    c = req("c", list(range(40, 48)))
    bm.allocate(c, [], 8)
    assert bm.num_cached_blocks == 4
    # Next allocations evict in LRU order, and within a request its tail block first.
    d = req("d", list(range(60, 64)))
    bm.allocate(d, [], 4)
    assert d.block_ids == [a_cached[1]]
    assert bm.match_prefix(req("pa", [*range(8), 1])) == a_cached[:1]
    e = req("e", list(range(70, 74)))
    bm.allocate(e, [], 4)
    assert e.block_ids == [a_cached[0]]
    assert bm.match_prefix(req("pb", [*range(20, 28), 1])) == b_cached
    bm.check_invariants([c, d, e])


def test_referenced_cached_blocks_are_never_evicted() -> None:
    bm = BlockManager(3, BS)
    a = req("a", [*range(8), 1])
    admit(bm, a)  # holds all 3 blocks, 2 of them cached
    assert bm.num_free_blocks == 0
    assert not bm.can_allocate([], 1)
    # A hit on a block with ref count 0 takes it out of the allocatable pool.
    bm.free(a)
    b = req("b", [*range(8), 2])
    hits = bm.match_prefix(b)
    assert len(hits) == 2
    assert bm.can_allocate(hits, 9)  # 2 revived + 1 fresh of 3
    assert not bm.can_allocate(hits, 13)  # would need 2 fresh, only 1 left
    bm.allocate(b, hits, 9)
    assert bm.num_free_blocks == 0
    bm.check_invariants([b])


def test_duplicate_prefix_computed_concurrently_is_not_registered_twice() -> None:
    bm = BlockManager(8, BS)
    a, b = req("a", list(range(5))), req("b", list(range(5)))
    bm.allocate(a, bm.match_prefix(a), 5)
    bm.allocate(b, bm.match_prefix(b), 5)  # no hit yet: a has not computed anything
    bm.cache_full_blocks(a, 5)
    bm.cache_full_blocks(b, 5)
    assert bm.num_cached_blocks == 1
    bm.free(a)
    bm.free(b)
    bm.check_invariants([])
    assert bm.num_free_blocks == 8


def test_prefix_caching_disabled_never_hits() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = req("a", [*range(8), 1])
    admit(bm, a)
    assert bm.match_prefix(req("b", [*range(8), 1])) == []
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits, bm.num_cached_blocks) == (0, 0, 0)


def test_reset_prefix_cache_forgets_only_unreferenced_blocks() -> None:
    bm = BlockManager(8, BS)
    a, b = req("a", [*range(8), 1]), req("b", [*range(20, 28), 1])
    admit(bm, a)
    admit(bm, b)
    bm.free(a)
    assert bm.reset_prefix_cache() == 2
    assert bm.match_prefix(req("pa", [*range(8), 1])) == []
    assert bm.match_prefix(req("pb", [*range(20, 28), 1])) == b.block_ids[:2]
    bm.check_invariants([b])
