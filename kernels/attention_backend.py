"""The `triton` attention backend: when every sequence has exactly one new token, the decode
kernel, which also stores the new K/V; otherwise store_kv, then the varlen prefill kernel.
Grids come from the host ints in AttentionMetadata, so a forward never syncs with the device."""
from __future__ import annotations

import torch

from engine.worker.attention import AttentionMetadata
from kernels.paged_attention import paged_attention_decode, paged_attention_prefill
from kernels.store_kv import store_kv


class TritonAttention:
    name = "triton"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        if meta.is_decode_only and q.shape[0] == meta.num_seqs:  # the decode kernel stores
            return paged_attention_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                          scale, max_seq_len=meta.max_seq_len,
                                          new_kv=(k, v, meta.slot_mapping))
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return paged_attention_prefill(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                       meta.query_start_loc, meta.max_query_len, scale)
