"""Block manager: allocation, prefix sharing, LRU eviction and invariants (no torch)."""
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.block_manager import BlockManager, block_key


def admit_prompt(bm: BlockManager, rid: str, tokens: list[int],
                 cache_salt: str | None = None) -> list[int]:
    cached = bm.find_cached_prefix(tokens, cache_salt)
    assert bm.admit(rid, tokens, cached, len(tokens) - len(cached) * bm.block_size, cache_salt)
    return cached


def admit_and_cache(bm: BlockManager, rid: str, tokens: list[int],
                    cache_salt: str | None = None) -> list[int]:
    """Admit a prompt and cache its full blocks, as its prefill would; returns its hits."""
    cached = admit_prompt(bm, rid, tokens, cache_salt)
    bm.cache_full_blocks(rid, tokens, len(tokens))
    return cached


def test_prefix_blocks_are_shared_and_last_token_recomputed():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(12))  # exactly three full blocks
    admit_prompt(bm, "a", prompt)
    bm.cache_full_blocks("a", prompt, len(prompt))
    cached = admit_prompt(bm, "b", prompt)
    # the last block is not reused: its last token must be recomputed to get logits
    assert len(cached) == 2
    assert bm.block_ids("b")[:2] == bm.block_ids("a")[:2]
    assert bm.block_ids("b")[2] != bm.block_ids("a")[2]
    assert bm.blocks[bm.block_ids("a")[0]].ref_count == 2
    assert bm.prefix_hits == 8 and bm.prefix_queries == 24
    bm.check_invariants()


def test_hash_chain_depends_on_whole_prefix():
    bm = BlockManager(num_blocks=16, block_size=4)
    admit_prompt(bm, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.cache_full_blocks("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], 9)
    # [5, 6, 7, 8] is cached, but as the block after [1, 2, 3, 4]: no hit at position 0
    assert bm.find_cached_prefix([5, 6, 7, 8, 9]) == []
    assert len(bm.find_cached_prefix([1, 2, 3, 4, 5, 6, 7, 8, 0])) == 2
    assert block_key(b"", [1, 2]) != block_key(block_key(b"", [0]), [1, 2])


def test_freed_cached_blocks_are_reused_until_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    prompt = [7, 7, 8, 8, 9]
    admit_prompt(bm, "a", prompt)
    bm.cache_full_blocks("a", prompt, 4)
    bm.free("a")
    assert bm.num_free_blocks == 4
    assert len(bm.find_cached_prefix(prompt)) == 2  # still cached while free
    # the free queue is now [never used, a's tail, a's 2nd block, a's 1st block]: new
    # allocations take unused and tail blocks first, so the shared head survives longest
    assert bm.admit("x", [1, 2, 3, 4], [], 4)
    assert len(bm.find_cached_prefix(prompt)) == 2
    assert bm.admit("y", [5, 6], [], 2)
    assert len(bm.find_cached_prefix(prompt)) == 1
    bm.check_invariants()


def test_admit_fails_without_side_effects_when_pool_is_short():
    bm = BlockManager(num_blocks=2, block_size=4)
    assert not bm.admit("a", list(range(9)), [], 9)
    assert bm.num_free_blocks == 2 and bm.prefix_queries == 0
    bm.check_invariants()


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    admit_prompt(bm, "a", [1, 2, 3])
    bm.cache_full_blocks("a", [1, 2, 3], 3)
    assert bm.find_cached_prefix([1, 2, 3]) == []


def test_invariant_check_catches_corruption():
    bm = BlockManager(num_blocks=4, block_size=2)
    admit_prompt(bm, "a", [1, 2, 3])
    bm.blocks[bm.block_ids("a")[0]].ref_count += 1
    with pytest.raises(AssertionError):
        bm.check_invariants()


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4]),
       seed=st.integers(0, 10**6))
def test_random_operations_keep_invariants(num_blocks, block_size, seed):
    rng = random.Random(seed)
    bm = BlockManager(num_blocks, block_size)
    live: dict[str, tuple[list[int], int]] = {}  # id -> (tokens, computed)
    for step in range(60):
        op = rng.random()
        if op < 0.4:
            tokens = [rng.randrange(3) for _ in range(rng.randint(1, 12))]
            cached = bm.find_cached_prefix(tokens)
            n_new = len(tokens) - len(cached) * block_size
            if bm.admit(f"r{step}", tokens, cached, n_new):
                live[f"r{step}"] = (tokens, len(tokens))
                bm.cache_full_blocks(f"r{step}", tokens, len(tokens))
        elif op < 0.7 and live:
            rid = rng.choice(sorted(live))
            tokens, computed = live[rid]
            tokens = tokens + [rng.randrange(3)]
            if bm.grow(rid, len(tokens)):
                live[rid] = (tokens, len(tokens))
                bm.cache_full_blocks(rid, tokens, len(tokens))
        elif live:
            rid = rng.choice(sorted(live))
            bm.free(rid)
            del live[rid]
        bm.check_invariants()
        for rid, (tokens, _) in live.items():
            assert len(bm.block_ids(rid)) == bm.blocks_needed(len(tokens))
    for rid in list(live):
        bm.free(rid)
    bm.check_invariants()
    assert bm.num_free_blocks == num_blocks


def test_shrink_releases_the_blocks_past_the_kept_tokens():
    bm = BlockManager(num_blocks=8, block_size=4)
    admit_prompt(bm, "a", list(range(5)))  # blocks for 5 tokens: 2
    assert bm.grow("a", 5 + 1 + 6)  # a speculative step: 12 tokens, 3 blocks
    table = bm.block_ids("a")
    bm.shrink("a", 7)  # 2 drafts accepted of 6
    assert bm.block_ids("a") == table[:2]
    assert bm.num_free_blocks == 6
    bm.check_invariants()
    # the released block is the next one handed out, ahead of older free blocks
    assert bm.grow("a", 9) and bm.block_ids("a") == table


def test_shrink_keeps_cached_blocks_cached_and_reuses_empty_ones_first():
    bm = BlockManager(num_blocks=5, block_size=2)
    admit_prompt(bm, "old", [9, 9, 9])
    bm.cache_full_blocks("old", [9, 9, 9], 3)
    cached_block = bm.block_ids("old")[0]
    bm.free("old")  # its first block stays in the prefix cache, free
    admit_prompt(bm, "a", [1, 2, 3])
    assert bm.grow("a", 7)
    bm.shrink("a", 4)
    assert bm.grow("a", 6)  # takes the block shrink released, not the cached one
    assert bm.find_cached_prefix([9, 9, 9]) == [cached_block]
    bm.check_invariants()


def test_shrink_refuses_to_cut_into_hashed_blocks():
    bm = BlockManager(num_blocks=4, block_size=2)
    tokens = [1, 2, 3, 4, 5]
    admit_prompt(bm, "a", tokens)
    bm.cache_full_blocks("a", tokens, 4)
    bm.shrink("a", 4)  # the hashed blocks end at 4: allowed
    with pytest.raises(ValueError, match="hashed"):
        bm.shrink("a", 3)


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(2, 16), block_size=st.sampled_from([1, 2, 4]),
       k=st.integers(1, 6), seed=st.integers(0, 10**6))
def test_speculative_grow_and_shrink_keep_invariants(num_blocks, block_size, k, seed):
    """Requests decode by speculation: grow for the last token plus k drafts, keep the
    accepted ones plus one, cache full blocks, shrink; afterwards a request's table covers its
    computed tokens and no more than all its tokens, and freeing everything returns every
    block."""
    rng = random.Random(seed)
    bm = BlockManager(num_blocks, block_size)
    live: dict[str, list[int]] = {}  # id -> tokens, all but the last computed
    for step in range(60):
        if rng.random() < 0.3:
            tokens = [rng.randrange(3) for _ in range(rng.randint(1, 8))]
            cached = bm.find_cached_prefix(tokens)
            if bm.admit(f"r{step}", tokens, cached, len(tokens) - len(cached) * block_size):
                live[f"r{step}"] = tokens
        elif live and rng.random() < 0.8:
            rid = rng.choice(sorted(live))
            tokens = live[rid]
            if bm.grow(rid, len(tokens) + k):
                tokens += [rng.randrange(3) for _ in range(rng.randint(1, k + 1))]
                bm.cache_full_blocks(rid, tokens, len(tokens) - 1)
                bm.shrink(rid, len(tokens))
                # covers the computed tokens; no block wholly past the last (uncomputed) one
                table = bm.block_ids(rid)
                assert bm.blocks_needed(len(tokens) - 1) <= len(table)
                assert len(table) <= bm.blocks_needed(len(tokens))
        elif live:
            rid = rng.choice(sorted(live))
            bm.free(rid)
            del live[rid]
        bm.check_invariants()
    for rid in live:
        bm.free(rid)
    assert bm.num_free_blocks == num_blocks


PROMPT = list(range(12))  # three full blocks of 4


def test_requests_with_different_salts_share_no_block():
    bm = BlockManager(num_blocks=16, block_size=4)
    admit_and_cache(bm, "a", PROMPT, cache_salt="tenant-1")
    assert admit_and_cache(bm, "b", PROMPT, cache_salt="tenant-2") == []
    assert not set(bm.block_ids("a")) & set(bm.block_ids("b"))
    assert bm.prefix_hits == 0
    bm.check_invariants()


def test_requests_with_the_same_salt_share_their_prefix():
    bm = BlockManager(num_blocks=16, block_size=4)
    admit_and_cache(bm, "a", PROMPT, cache_salt="tenant-1")
    assert len(admit_and_cache(bm, "b", PROMPT, cache_salt="tenant-1")) == 2
    assert bm.block_ids("b")[:2] == bm.block_ids("a")[:2]
    assert bm.prefix_hits == 8
    bm.check_invariants()


def test_salted_and_unsalted_requests_share_nothing():
    bm = BlockManager(num_blocks=16, block_size=4)
    admit_and_cache(bm, "plain", PROMPT)
    assert admit_and_cache(bm, "salted", PROMPT, cache_salt="tenant-1") == []
    assert not set(bm.block_ids("plain")) & set(bm.block_ids("salted"))
    # both prefixes are now cached; each lookup finds only its own
    assert bm.find_cached_prefix(PROMPT) == list(bm.block_ids("plain")[:2])
    assert bm.find_cached_prefix(PROMPT, "tenant-1") == list(bm.block_ids("salted")[:2])
    bm.check_invariants()


def test_the_salt_changes_only_the_first_key():
    bm = BlockManager(num_blocks=16, block_size=4)
    admit_and_cache(bm, "a", PROMPT, cache_salt="tenant-1")
    k0, k1, k2 = (bm.blocks[b].key for b in bm.block_ids("a"))
    assert k0 != block_key(b"", PROMPT[:4])
    assert k1 == block_key(k0, PROMPT[4:8]) and k2 == block_key(k1, PROMPT[8:])


@settings(max_examples=100, deadline=None)
@given(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4]),
       seed=st.integers(0, 10**6))
def test_random_tenants_never_share_a_block(num_blocks, block_size, seed):
    """Requests of random tenants (salt or none) with prompts from a tiny alphabet: every
    block a request holds under a key was keyed by its own tenant."""
    rng = random.Random(seed)
    bm = BlockManager(num_blocks, block_size)
    tenant_of: dict[bytes, str | None] = {}  # block key -> the salt whose request made it
    live = []
    for step in range(60):
        if live and rng.random() < 0.3:
            bm.free(live.pop(rng.randrange(len(live))))
            continue
        salt = rng.choice([None, "x", "y"])
        tokens = [rng.randrange(2) for _ in range(rng.randint(1, 9))]
        cached = bm.find_cached_prefix(tokens, salt)
        if bm.admit(f"r{step}", tokens, cached, len(tokens) - len(cached) * block_size, salt):
            live.append(f"r{step}")
            bm.cache_full_blocks(f"r{step}", tokens, len(tokens))
            for block_id in bm.block_ids(f"r{step}"):
                if (key := bm.blocks[block_id].key) is not None:
                    assert tenant_of.setdefault(key, salt) == salt
        bm.check_invariants()
