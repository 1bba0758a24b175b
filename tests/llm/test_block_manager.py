"""The block manager, exactly: which block ids a request gets, reference counts, prefix-cache hits,
eviction order (vLLM's tests/v1/core/test_prefix_caching.py style). Plain Python, no torch."""

import pytest

from kiln.llm.block_manager import NULL_BLOCK, BlockManager, hash_block
from kiln.llm.config import LLMError
from kiln.llm.request import Request

BS = 4  # tokens per block in these tests


def request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, list(tokens))


def admit(manager: BlockManager, req: Request, num_new: int | None = None) -> list[int] | None:
    """What the scheduler does for a waiting request: look up the prefix, allocate the rest."""
    hits, num_computed = manager.get_computed_blocks(req)
    num_new = req.num_tokens - num_computed if num_new is None else num_new
    new = manager.allocate_slots(req, num_new, hits)
    if new is not None:
        req.num_computed_tokens = num_computed
    return new


def refs(manager: BlockManager, ids) -> list[int]:
    return [manager.blocks[i].ref_count for i in ids]


def test_fresh_allocation_takes_blocks_in_order_and_never_the_null_block():
    m = BlockManager(num_blocks=10, block_size=BS)
    assert m.num_free_blocks == 9 and NULL_BLOCK not in m.free_queue
    a = request("a", range(10))  # 10 tokens: 3 blocks, 2 full
    assert admit(m, a) == [1, 2, 3]
    assert m.block_ids("a") == [1, 2, 3] and refs(m, [1, 2, 3]) == [1, 1, 1]
    assert m.num_free_blocks == 6
    # the two full blocks are registered under their chained hashes; the partial one is not
    h0 = hash_block(None, [0, 1, 2, 3])
    h1 = hash_block(h0, [4, 5, 6, 7])
    assert m.cached == {h0: 1, h1: 2} and m.blocks[3].hash is None
    assert a.block_hashes == [h0, h1]


def test_hash_chain_distinguishes_equal_blocks_after_different_prefixes():
    h_a = hash_block(hash_block(None, [1, 2, 3, 4]), [9, 9, 9, 9])
    h_b = hash_block(hash_block(None, [5, 6, 7, 8]), [9, 9, 9, 9])
    assert h_a != h_b
    assert hash_block(None, [1, 2, 3, 4]) == hash_block(None, (1, 2, 3, 4))


def test_prefix_hit_shares_blocks_and_stops_one_token_short():
    m = BlockManager(10, BS)
    a = request("a", range(10))
    admit(m, a)
    b = request("b", list(range(8)) + [50, 51, 52])  # shares a's two full blocks
    hits, computed = m.get_computed_blocks(b)
    assert hits == [1, 2] and computed == 8
    assert admit(m, b) == [4]
    assert m.block_ids("b") == [1, 2, 4] and refs(m, [1, 2, 3, 4]) == [2, 2, 1, 1]
    assert b.num_computed_tokens == 8
    # exactly two full blocks of prompt: the last token must be computed, so only the first block hits
    c = request("c", range(8))
    assert m.get_computed_blocks(c) == ([1], 4)
    assert admit(m, c) == [5]
    assert m.block_ids("c") == [1, 5]
    assert m.prefix_queries == 10 + 11 + 8 and m.prefix_hits == 8 + 4


def test_free_returns_blocks_to_the_queue_tail_last_block_first():
    m = BlockManager(8, BS)
    a = request("a", range(12))  # 3 full blocks: 1, 2, 3
    admit(m, a)
    assert list(m.free_queue) == [4, 5, 6, 7]
    m.free(a)
    assert list(m.free_queue) == [4, 5, 6, 7, 3, 2, 1]  # a's tail is evicted before its head
    assert refs(m, [1, 2, 3]) == [0, 0, 0]
    assert m.cached  # still cached while free


def test_eviction_takes_the_lru_front_and_forgets_its_hash():
    m = BlockManager(6, BS)  # usable blocks 1..5
    a = request("a", range(8))  # blocks 1, 2 (both full)
    admit(m, a)
    m.free(a)  # queue: 3 4 5 2 1
    assert list(m.free_queue) == [3, 4, 5, 2, 1]
    b = request("b", range(100, 116))  # 4 blocks, no hit: takes 3, 4, 5 then evicts 2 (a's second block)
    assert admit(m, b) == [3, 4, 5, 2]
    h0 = hash_block(None, [0, 1, 2, 3])
    assert m.cached.get(h0) == 1 and hash_block(h0, [4, 5, 6, 7]) not in m.cached
    assert m.blocks[2].hash == b.block_hashes[3]
    # a comes back: its first block survived, the second was evicted
    a2 = request("a2", range(8))
    assert m.get_computed_blocks(a2) == ([1], 4)


def test_a_hit_on_a_free_block_takes_it_out_of_the_free_queue():
    m = BlockManager(6, BS)
    a = request("a", range(9))
    admit(m, a)  # 1, 2, 3
    m.free(a)  # queue: 4 5 3 2 1
    b = request("b", list(range(8)) + [7, 7])  # hits 1, 2 (both free, ref 0)
    assert admit(m, b) == [4]
    assert refs(m, [1, 2, 4]) == [1, 1, 1]
    assert list(m.free_queue) == [5, 3]


def test_allocation_fails_atomically_when_short_counting_revived_hits():
    m = BlockManager(5, BS)  # usable 1..4
    a = request("a", range(8))
    admit(m, a)  # 1, 2
    m.free(a)  # queue 3 4 2 1; all four free
    # 17 tokens: hits 1, 2 (free: reviving them uses 2 of the 4 free), needs 3 more: 5 > 4
    big = request("big", list(range(8)) + list(range(200, 209)))
    before = (list(m.free_queue), dict(m.cached), refs(m, range(5)))
    assert admit(m, big) is None
    assert (list(m.free_queue), dict(m.cached), refs(m, range(5))) == before
    assert "big" not in m.request_blocks and m.prefix_queries == 8


def test_growing_a_running_request_block_by_block():
    m = BlockManager(10, BS)
    a = request("a", range(3))
    assert admit(m, a) == [1]
    a.num_computed_tokens = 3
    for token in (3,):  # fills block 1: no new block
        a.append_token(token)
    assert m.allocate_slots(a, 1) == []
    a.num_computed_tokens = 4
    assert m.blocks[1].hash == hash_block(None, [0, 1, 2, 3])  # registered once its tokens are known
    a.append_token(4)
    assert m.allocate_slots(a, 1) == [2]
    assert m.block_ids("a") == [1, 2]


def test_draft_tokens_get_slots_but_are_not_hashed():
    m = BlockManager(10, BS)
    a = request("a", range(3))
    admit(m, a)
    a.num_computed_tokens = 3
    a.append_token(3)  # 4 known tokens, the 4th not computed yet; 5 drafts more
    assert m.allocate_slots(a, 1 + 5) == [2, 3]  # positions 3..8: blocks 1, 2, 3
    assert m.blocks[1].hash is not None  # tokens 0..3 are known
    assert m.blocks[2].hash is None  # drafts only


def test_duplicate_content_in_one_step_is_computed_once():
    m = BlockManager(10, BS)
    a = request("a", range(9))
    b = request("b", range(9))
    assert admit(m, a) == [1, 2, 3]
    assert admit(m, b) == [4]  # same step: a's blocks are registered at allocation, b hits them
    assert m.block_ids("b") == [1, 2, 4]


def test_reset_prefix_cache_keeps_blocks_in_use():
    m = BlockManager(10, BS)
    a, b = request("a", range(8)), request("b", range(50, 58))
    admit(m, a)
    admit(m, b)
    m.free(a)
    assert m.reset_prefix_cache() == 2
    assert set(m.cached.values()) == {3, 4}
    assert m.get_computed_blocks(request("a2", range(9))) == ([], 0)


def test_prefix_caching_off_never_hits():
    m = BlockManager(10, BS, enable_prefix_caching=False)
    a = request("a", range(9))
    admit(m, a)
    m.free(a)
    assert m.cached == {} and m.get_computed_blocks(request("b", range(9))) == ([], 0)


def test_usage_and_too_small_a_cache():
    m = BlockManager(5, BS)
    assert m.usage == 0.0
    admit(m, request("a", range(8)))
    assert m.usage == 0.5
    with pytest.raises(LLMError, match="at least 2 blocks"):
        BlockManager(1, BS)


def test_random_workload_keeps_the_invariants():
    """Random admissions, growth and frees: reference counts equal the holders, free blocks are exactly
    those with count 0, the cache maps only to blocks that carry that hash."""
    import random

    rng = random.Random(0)
    m = BlockManager(24, BS)
    live: dict[str, Request] = {}
    for step in range(400):
        action = rng.random()
        if action < 0.4 and len(live) < 6:
            prefix = rng.choice([[], list(range(8)), list(range(12))])
            req = request(f"r{step}", prefix + [rng.randrange(50) for _ in range(rng.randrange(1, 10))])
            if admit(m, req) is not None:
                req.num_computed_tokens = req.num_tokens
                live[req.request_id] = req
        elif action < 0.8 and live:
            req = live[rng.choice(sorted(live))]
            req.append_token(rng.randrange(50))
            if m.allocate_slots(req, 1) is not None:
                req.num_computed_tokens += 1
        elif live:
            m.free(live.pop(rng.choice(sorted(live))))
        holders = {}
        for rid in live:
            for b in m.block_ids(rid):
                holders[b] = holders.get(b, 0) + 1
        for block in m.blocks[1:]:
            assert block.ref_count == holders.get(block.block_id, 0)
            assert (block.ref_count == 0) == (block.block_id in m.free_queue)
        for h, b in m.cached.items():
            assert m.blocks[b].hash == h
