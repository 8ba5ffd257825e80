"""Attention over the paged KV cache: the backend interface and the `torch` reference backend.

Cache: per layer, k_cache and v_cache of [num_blocks, block_size, num_heads, head_dim].
A batch is varlen, the new tokens of all sequences concatenated:

    query tokens   | seq 0 (3 new) | seq 1 (1 new) | seq 2 (5 new) |
    query_start_loc  0               3               4               9
    seq_lens       cached + new tokens of each sequence (its context after this step)

A backend writes the new K and V at `slot_mapping` (never slot -1, padding), then attends
causally over each sequence's cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 for padding
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    max_query_len: int
    max_seq_len: int
    query_start_loc_host: list[int] | None = None  # host copies, for host-looping backends
    seq_lens_host: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(Protocol):
    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q, k, v: [num_tokens, num_heads, head_dim]. Writes k, v into the cache at
        meta.slot_mapping, then returns attention output [num_tokens, num_heads, head_dim]."""
        ...


def store_kv_reference(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new K/V rows into the cache's flat slots, skipping slot -1."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    num_blocks, block_size, heads, dim = k_cache.shape
    k_cache.view(num_blocks * block_size, heads, dim).index_copy_(0, slots, k[valid])
    v_cache.view(num_blocks * block_size, heads, dim).index_copy_(0, slots, v[valid])


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len cached rows of one sequence: [seq_len, num_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    rows = cache[block_table[:num_blocks].long()]  # [n, block_size, H, D]
    return rows.reshape(-1, *cache.shape[2:])[:seq_len]


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of each new token over its sequence's cached context, in float32."""
    out = torch.empty_like(q)
    starts = meta.query_start_loc_host or meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens_host or meta.seq_lens.tolist()
    for i, seq_len in enumerate(seq_lens):
        q_seq = q[starts[i]:starts[i + 1]].float()  # [nq, H, D]
        nq = q_seq.shape[0]
        if nq == 0:
            continue
        keys = gather_context(k_cache, meta.block_tables[i], seq_len).float()
        values = gather_context(v_cache, meta.block_tables[i], seq_len).float()
        scores = torch.einsum("qhd,khd->hqk", q_seq, keys) * scale
        # query j sits at position seq_len - nq + j and sees keys at positions <= its own
        q_pos = torch.arange(seq_len - nq, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[starts[i]:starts[i + 1]] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out


class TorchAttention:
    """Pure PyTorch, runs anywhere: the oracle the Triton kernels are tested against."""
    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        store_kv_reference(k, v, k_cache, v_cache, meta.slot_mapping)
        return paged_attention_reference(q, k_cache, v_cache, meta, scale)


def get_attention_backend(name: str) -> AttentionBackend:
    if name == "torch":
        return TorchAttention()
    if name == "triton":
        from engine.worker.triton_ops import TritonAttention

        return TritonAttention()
    raise ValueError(f"unknown attention backend {name!r}: choose 'torch' or 'triton'")
