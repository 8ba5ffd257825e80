"""Write this step's new K/V rows into the paged cache.

One program per token copies its [num_heads * head_dim] rows of K and V into its slot (two
unit-stride runs when heads are packed); slot -1 (padding) returns before touching the cache.
Reference: `engine.worker.attention.store_kv_reference`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_options, pdl_prologue


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch,
                     NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
                     USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK)
    head = offs // HEAD_DIM
    dim = offs % HEAD_DIM
    mask = offs < NUM_HEADS * HEAD_DIM
    src_k = k_ptr + token.to(tl.int64) * stride_kt + head * stride_kh + dim
    src_v = v_ptr + token.to(tl.int64) * stride_vt + head * stride_vh + dim
    dst = slot * stride_cs + head * stride_ch + dim
    tl.store(k_cache_ptr + dst, tl.load(src_k, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(src_v, mask=mask), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [num_tokens, H, D] (last dim contiguous); caches: [num_blocks, block_size, H, D]
    contiguous; slot_mapping: [num_tokens], -1 for padding."""
    num_tokens, heads, dim = k.shape
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.is_contiguous()
    assert v_cache.is_contiguous() and k_cache.stride() == v_cache.stride()
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=heads, HEAD_DIM=dim, BLOCK=triton.next_power_of_2(heads * dim), num_warps=4,
        **pdl_options(k.device))
