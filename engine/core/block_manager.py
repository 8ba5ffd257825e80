"""Paged KV-cache bookkeeping: blocks, ref counts, an LRU free queue and a prefix cache.
Pure Python; the model runner only reads the block tables it produces.

    request A  prompt "The cat sat on the mat and then"  (block_size 4)
    block table [ 3 | 8 | 5 ]        3, 8 full -> hashed and shareable; 5 partial -> private
    request B  prompt "The cat sat on the mat, but"
    block table [ 3 | 11 | ...]      hit on block 3 (ref count 2), miss on the second block

A full block's key names its whole prefix: key(i) = sha256(key(i-1) || tokens of block i),
key(-1) empty or a hash of the request's cache_salt (sharing stays within a tenant). Freed
blocks keep their key until a new allocation evicts them, least recently freed first.

A fork (a beam search's new beam) shares its parent's blocks the same way, by reference
count; the partial last block, which both would write next, is copied instead: the child
gets a fresh block and a (src, dst) copy that the runner applies before the next forward.
So a block held by two tables is never written again.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

BlockKey = bytes
_ROOT_KEY: BlockKey = b""


def _root_key(cache_salt: str | None) -> BlockKey:
    """Empty without a salt; the tag keeps a salted root's hash input apart from any block's
    tokens (b"cache_sa" as an int64 is no token id)."""
    if cache_salt is None:
        return _ROOT_KEY
    return hashlib.sha256(b"cache_salt\0" + cache_salt.encode()).digest()


def block_key(parent: BlockKey, token_ids: list[int]) -> BlockKey:
    """sha256 over the parent key and the block's tokens: collisions would serve wrong KV."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    key: BlockKey | None = None  # set once the block is full and registered in the cache


@dataclass
class _RequestBlocks:
    block_ids: tuple[int, ...] = ()  # a tuple, replaced on growth: steps hold it uncopied
    keys: list[BlockKey] = field(default_factory=list)  # keys of the leading full blocks
    root: BlockKey = _ROOT_KEY  # the parent of keys[0]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got "
                             f"{num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockKey, int] = {}
        self._requests: dict[str, _RequestBlocks] = {}
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens served from cached blocks

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_tokens(self) -> int:
        """Tokens the whole pool holds: no request can be longer."""
        return self.num_blocks * self.block_size

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def block_ids(self, request_id: str) -> tuple[int, ...]:
        return self._requests[request_id].block_ids

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -------------------------------------------------------------- admission
    def find_cached_prefix(self, token_ids: list[int],
                           cache_salt: str | None = None) -> list[int]:
        """Cached blocks holding a prefix of token_ids under cache_salt; always leaves at least
        one token to compute (its logits are sampled)."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        key = _root_key(cache_salt)
        max_full = (len(token_ids) - 1) // self.block_size
        for i in range(max_full):
            key = block_key(key, token_ids[i * self.block_size:(i + 1) * self.block_size])
            block_id = self._cached.get(key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def admit(self, request_id: str, token_ids: list[int], cached: list[int],
              num_new_tokens: int, cache_salt: str | None = None) -> bool:
        """Take the `cached` blocks (find_cached_prefix's, same cache_salt) plus fresh ones
        for num_new_tokens past them. False, changing nothing, if out of blocks."""
        assert request_id not in self._requests, f"{request_id} already holds blocks"
        num_tokens = len(cached) * self.block_size + num_new_tokens
        # a cached block with no owner sits in the free queue: taking it uses up a free block
        revived = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        fresh = self.blocks_needed(num_tokens) - len(cached)
        if fresh + revived > self.num_free_blocks:
            return False
        self.prefix_queries += len(token_ids)
        self.prefix_hits += len(cached) * self.block_size
        entry = _RequestBlocks(root=_root_key(cache_salt))
        self._requests[request_id] = entry
        for block_id in cached:
            self._take(block_id)
            entry.keys.append(self.blocks[block_id].key)  # type: ignore[arg-type]
        entry.block_ids = tuple(cached) + tuple(self._pop_free() for _ in range(fresh))
        return True

    def grow(self, request_id: str, num_tokens: int) -> bool:
        """Make the request's table cover num_tokens. False, changing nothing, if out of blocks."""
        entry = self._requests[request_id]
        if num_tokens <= len(entry.block_ids) * self.block_size:
            return True
        fresh = self.blocks_needed(num_tokens) - len(entry.block_ids)
        if fresh > self.num_free_blocks:
            return False
        entry.block_ids += tuple(self._pop_free() for _ in range(max(fresh, 0)))
        return True

    def shrink(self, request_id: str, num_tokens: int) -> None:
        """Cut the table to cover num_tokens, releasing the blocks wholly past them. They hold
        no cached prefix, so they go to the front of the free queue (reused before evicting)."""
        entry = self._requests[request_id]
        if num_tokens < len(entry.keys) * self.block_size:
            raise ValueError(f"cannot shrink {request_id} to {num_tokens} tokens: its first "
                             f"{len(entry.keys)} blocks are full and hashed; later tokens would "
                             "overwrite their KV")
        keep = self.blocks_needed(num_tokens)
        for block_id in reversed(entry.block_ids[keep:]):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                self._free.move_to_end(block_id, last=False)
        entry.block_ids = entry.block_ids[:keep]

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> list[tuple[int, int]] | None:
        """Give child_id a table for the parent's first num_tokens tokens, sharing the
        parent's blocks (ref counts + 1), but for a partial last block, which both would write
        next: the child gets a fresh block instead, to be filled with the parent's first
        (copy on write). Returns those copies, [(src, dst)] or []; None, changing nothing, if
        no block is free for the copy."""
        assert child_id not in self._requests, f"{child_id} already holds blocks"
        parent = self._requests[parent_id]
        keep = self.blocks_needed(num_tokens)
        partial = num_tokens % self.block_size != 0
        if partial and not self._free:
            return None
        shared = parent.block_ids[:keep - 1] if partial else parent.block_ids[:keep]
        for block_id in shared:
            self.blocks[block_id].ref_count += 1
        copies = [(parent.block_ids[keep - 1], self._pop_free())] if partial else []
        self._requests[child_id] = _RequestBlocks(shared + tuple(dst for _, dst in copies),
                                                  parent.keys[:num_tokens // self.block_size],
                                                  parent.root)
        return copies

    def cache_full_blocks(self, request_id: str, token_ids: list[int], num_computed: int) -> None:
        """Register every block whose tokens are all computed, so later requests can share it."""
        if not self.enable_prefix_caching:
            return
        entry = self._requests[request_id]
        for i in range(len(entry.keys), num_computed // self.block_size):
            parent = entry.keys[-1] if entry.keys else entry.root
            key = block_key(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
            entry.keys.append(key)
            block = self.blocks[entry.block_ids[i]]
            if key not in self._cached:  # an identical block may exist: keep the first
                block.key = key
                self._cached[key] = block.block_id

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first, so its tail is evicted before its head."""
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return
        for block_id in reversed(entry.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None

    # --------------------------------------------------------------- internals
    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.key is not None:  # evict: its KV is about to be overwritten
            del self._cached[block.key]
            block.key = None
        block.ref_count = 1
        return block_id

    def check_invariants(self) -> None:
        """Assert the bookkeeping is consistent (cheap: tests call it after every step)."""
        refs = [0] * self.num_blocks
        for entry in self._requests.values():
            for block_id in entry.block_ids:
                refs[block_id] += 1
        used = sum(1 for r in refs if r > 0)
        assert used + len(self._free) == self.num_blocks, "free + used != total"
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], f"ref count of {block}"
            assert (block.ref_count == 0) == (block.block_id in self._free), f"free list {block}"
        for entry in self._requests.values():
            assert len(entry.keys) <= len(entry.block_ids), "more keys than blocks"
        for key, block_id in self._cached.items():
            assert self.blocks[block_id].key == key, "cache map disagrees with block key"
        assert sum(b.key is not None for b in self.blocks) == len(self._cached)
