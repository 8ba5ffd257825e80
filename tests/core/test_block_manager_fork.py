"""BlockManager.fork, as beam search forks beams: a child shares its parent's blocks by
reference count and gets a copy of a partial last block (copy on write). Random admissions,
computes, forks and frees over a fake KV store keep the invariants, never write a block that
two tables hold, and let every request read back, through its own table, the KV of exactly
its own tokens."""
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.block_manager import BlockManager


class FakeKV:
    """What a forward writes: slot -> the token prefix whose last token's KV it holds."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.slots: dict[int, tuple[int, ...]] = {}

    def slot(self, rid: str, position: int) -> int:
        size = self.bm.block_size
        return self.bm.block_ids(rid)[position // size] * size + position % size

    def write(self, rid: str, tokens: list[int], start: int, end: int) -> None:
        for position in range(start, end):
            block = self.bm.blocks[self.bm.block_ids(rid)[position // self.bm.block_size]]
            assert block.ref_count == 1, f"{rid} writes block {block.block_id}, held by others"
            self.slots[self.slot(rid, position)] = tuple(tokens[:position + 1])

    def copy(self, copies: list[tuple[int, int]]) -> None:
        size = self.bm.block_size
        for src, dst in copies:
            for offset in range(size):
                value = self.slots.get(src * size + offset)
                self.slots.pop(dst * size + offset, None)
                if value is not None:
                    self.slots[dst * size + offset] = value

    def check(self, rid: str, tokens: list[int], computed: int) -> None:
        for position in range(computed):
            assert self.slots.get(self.slot(rid, position)) == tuple(tokens[:position + 1]), \
                f"{rid} reads wrong KV at {position}"


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4]),
       caching=st.booleans(), seed=st.integers(0, 10**6))
def test_random_forks_keep_invariants_and_each_request_its_own_kv(num_blocks, block_size,
                                                                   caching, seed):
    rng = random.Random(seed)
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    kv = FakeKV(bm)
    live: dict[str, tuple[list[int], int]] = {}  # id -> (tokens, computed)
    forks = 0
    for step in range(80):
        op, rid = rng.random(), f"r{step}"
        if op < 0.25:  # admit a prompt, its cached prefix shared, and compute it
            tokens = [rng.randrange(2) for _ in range(rng.randint(1, 10))]
            cached = bm.find_cached_prefix(tokens)
            num_cached = len(cached) * block_size
            if bm.admit(rid, tokens, cached, len(tokens) - num_cached):
                kv.write(rid, tokens, num_cached, len(tokens))
                bm.cache_full_blocks(rid, tokens, len(tokens))
                live[rid] = (tokens, len(tokens))
        elif op < 0.55 and live:  # decode: one more token, its KV written
            parent = rng.choice(sorted(live))
            tokens, computed = live[parent]
            tokens = tokens + [rng.randrange(2)]
            if bm.grow(parent, len(tokens)):
                kv.write(parent, tokens, computed, len(tokens))
                bm.cache_full_blocks(parent, tokens, len(tokens))
                live[parent] = (tokens, len(tokens))
        elif op < 0.85 and live:  # fork a beam: shared blocks, a copied partial one
            parent = rng.choice(sorted(live))
            tokens, computed = live[parent]
            free_before = bm.num_free_blocks
            copies = bm.fork(parent, rid, computed)
            partial = computed % block_size != 0
            if copies is None:
                assert partial and free_before == 0
            else:
                assert len(copies) == partial and bm.num_free_blocks == free_before - partial
                kv.copy(copies)
                live[rid] = (list(tokens), computed)
                forks += 1
                assert bm.block_ids(rid)[:computed // block_size] == \
                    bm.block_ids(parent)[:computed // block_size]
        elif live:
            victim = rng.choice(sorted(live))
            bm.free(victim)
            del live[victim]
        bm.check_invariants()
        for request, (tokens, computed) in live.items():
            kv.check(request, tokens, computed)
    for request in list(live):
        bm.free(request)
    bm.check_invariants()
    assert bm.num_free_blocks == num_blocks


def test_a_fork_shares_full_blocks_and_copies_the_partial_one():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.admit("a", list(range(10)), [], 10)
    bm.cache_full_blocks("a", list(range(10)), 10)
    parent = bm.block_ids("a")
    [(src, dst)] = bm.fork("a", "b", 10)
    child = bm.block_ids("b")
    assert child[:2] == parent[:2] and src == parent[2] and dst == child[2] != src
    assert [bm.blocks[b].ref_count for b in parent] == [2, 2, 1]
    assert bm.fork("a", "c", 8) == []  # at a block boundary: nothing to copy
    assert bm.block_ids("c") == parent[:2]
    bm.check_invariants()
    for rid in "abc":
        bm.free(rid)
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_a_fork_without_a_free_block_for_its_copy_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    assert bm.admit("a", list(range(10)), [], 10)
    assert bm.fork("a", "b", 10) is None
    assert bm.num_free_blocks == 0 and [bm.blocks[b].ref_count for b in bm.block_ids("a")] == \
        [1, 1, 1]
    with pytest.raises(KeyError):
        bm.block_ids("b")
    bm.check_invariants()


def test_invariant_check_catches_a_ref_count_that_misses_a_fork():
    bm = BlockManager(num_blocks=4, block_size=4)
    assert bm.admit("a", list(range(8)), [], 8)
    bm.fork("a", "b", 8)
    bm.blocks[bm.block_ids("b")[0]].ref_count -= 1  # as if the fork forgot one
    with pytest.raises(AssertionError, match="ref count"):
        bm.check_invariants()
