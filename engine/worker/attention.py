"""Attention over the paged KV cache: the backend interface and the `torch` reference backend.

Cache layout, one tensor per layer for K and one for V:

    k_cache[num_blocks, block_size, num_heads, head_dim]

A batch is laid out varlen: the new tokens of all sequences are concatenated.

    query tokens   | seq 0 (3 new) | seq 1 (1 new) | seq 2 (5 new) |
    query_start_loc  0               3               4               9
    seq_lens       cached + new tokens of each sequence (its context after this step)

Each new token attends causally to its sequence's cached tokens and to the new tokens up to and
including itself. A backend first writes the new K and V into the cache at `slot_mapping`
(slot -1 is padding and is never written), then attends.

A short step (at most SHORT_STEP_TOKENS tokens, e.g. a verification of k + 1 drafts) may also
carry each token as a decode row of its own: its sequence's block table and a length that
ends at the token (`per_token_rows`). Once the step's K/V are stored, every token's attention
is a decode over those, which the Triton backend runs split over the context, where the
prefill kernel would give each (query tile, head) one program walking the whole context.

    tokens      a5 a6 a7 b12               (A: 3 new at 5..7; B: 1 new at 12)
    tables      A  A  A  B                 per_token_tables: the sequence's row per token
    lengths     6  7  8  13                per_token_lens: position + 1
"""
from __future__ import annotations

from dataclasses import dataclass, replace
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
    # host copies (lists) of query_start_loc and seq_lens, for backends that loop on the host
    query_start_loc_host: list[int] | None = None
    seq_lens_host: list[int] | None = None
    # a short step's tokens as decode rows (see the module docstring), or None
    per_token_tables: torch.Tensor | None = None  # [num_tokens, max_blocks_per_seq] int32
    per_token_lens: torch.Tensor | None = None  # [num_tokens] int32

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


SHORT_STEP_TOKENS = 16  # the smallest mixed-step graph: graph and eager steps choose alike


def per_token_rows(meta: AttentionMetadata, positions: torch.Tensor) -> AttentionMetadata:
    """`meta` with its tokens as decode rows too; `positions`: each token's. Computed on the
    device (inside a graph too); a token past the last sequence's (padding) takes the last
    sequence row's table."""
    tokens = torch.arange(len(positions), dtype=torch.int32, device=positions.device)
    seq_of_token = torch.searchsorted(meta.query_start_loc[1:], tokens, right=True)
    seq_of_token = seq_of_token.clamp_(max=meta.num_seqs - 1)
    return replace(meta, per_token_tables=meta.block_tables.index_select(0, seq_of_token),
                   per_token_lens=(positions + 1).int())


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
    """Scatter new K/V rows into the flat slot view of the cache, skipping slot -1."""
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
    """Pure PyTorch: scatter into the cache, gather blocks, softmax. Runs anywhere; the oracle
    that the Triton kernels are tested against."""
    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        store_kv_reference(k, v, k_cache, v_cache, meta.slot_mapping)
        return paged_attention_reference(q, k_cache, v_cache, meta, scale)


def get_attention_backend(name: str) -> AttentionBackend:
    if name == "torch":
        return TorchAttention()
    if name == "triton":
        from kernels.backend import TritonAttention

        return TritonAttention()
    raise ValueError(f"unknown attention backend {name!r}: choose 'torch' or 'triton'")
