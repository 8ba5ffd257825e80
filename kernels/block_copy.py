"""Copy on write of paged KV blocks, every layer's K and V at once, for pairs the device
holds: `pairs` is int64 [1 + 2P], the count n, then P sources, then P destinations; block
dst[i] of each cache becomes block src[i], for i < n. The count is read on the device, so one
CUDA graph serves any step's pairs (engine/worker/cuda_graphs/block_copy_graph.py).

Grid (cache, chunk of a block): each program walks the n pairs over its chunk of its cache.
No destination is another pair's source, so the order of the stores does not matter.
Reference: `engine.worker.layers.copy_staged_blocks`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_options, pdl_prologue

CHUNK = 4096  # elements a program moves per pair: 8 KB at 16 bits, a GPT-2 block in 3-7 chunks


@triton.jit
def _copy_blocks_kernel(storage_ptr, pairs_ptr, max_pairs, num_blocks, block_numel,
                        CHUNK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    cache = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    ok = offs < block_numel
    base = storage_ptr + cache * num_blocks * block_numel + offs
    count = tl.load(pairs_ptr)
    for i in range(count):
        src = tl.load(pairs_ptr + 1 + i)
        dst = tl.load(pairs_ptr + 1 + max_pairs + i)
        tl.store(base + dst * block_numel, tl.load(base + src * block_numel, mask=ok), mask=ok)


def copy_staged_blocks(storage: torch.Tensor, pairs: torch.Tensor) -> None:
    """storage [caches..., num_blocks, *block] (contiguous; allocate_kv_caches' is [layers, 2,
    num_blocks, *block]); pairs int64 [1 + 2P] on its device (module docstring)."""
    assert storage.is_contiguous() and pairs.dtype == torch.int64 and pairs.is_contiguous()
    num_blocks, max_pairs = storage.shape[2], (pairs.numel() - 1) // 2
    caches = storage.shape[0] * storage.shape[1]
    block_numel = storage[0, 0, 0].numel()
    _copy_blocks_kernel[(caches, triton.cdiv(block_numel, CHUNK))](
        storage, pairs, max_pairs, num_blocks, block_numel, CHUNK=CHUNK, num_warps=4,
        **pdl_options(storage.device))
