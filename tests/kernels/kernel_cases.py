"""Shared pieces of the kernel tests: device, sizes, tolerances and a paged-batch builder.

Under the interpreter every program runs in numpy on the CPU, so shapes shrink (2 heads, fewer
and shorter sequences); on CUDA the tests use GPT-2-sized shapes."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from engine.worker.attention import AttentionMetadata

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BLOCK_SIZES = [8, 16, 32]
NUM_HEADS = 2 if INTERPRET else 12
HEAD_DIM = 64
SCALE = HEAD_DIM ** -0.5


def tol(dtype: torch.dtype) -> dict:
    """fp32 is exact up to summation order (tl.dot runs with input_precision="ieee", no tf32);
    half types round inputs, P and outputs to 8-11 mantissa bits."""
    return dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)


def replayed_on_new_inputs(call, inputs: list[torch.Tensor]):
    """call() run once eagerly, captured in a CUDA graph, then replayed after each of `inputs`
    is refilled in place with fresh random values; returns what the captured call returned
    (its outputs as of the replay)."""
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = call()
    for tensor in inputs:
        tensor.copy_(torch.randn_like(tensor))
    graph.replay()
    torch.cuda.synchronize()
    return outputs


def context_lengths(n: int, block_size: int) -> list[int]:
    """Edge lengths first (full 1024, one token, block boundaries), then random odd ones."""
    edges = [1024, 1, block_size, block_size + 1, 1023, 2 * block_size - 1]
    rand = (torch.randint(0, 512, (n,)) * 2 + 1).tolist()
    return (edges + rand)[:n]


@dataclass
class PagedBatch:
    q: torch.Tensor  # [num_tokens + pad, H, D]
    k_new: torch.Tensor  # the new tokens' K/V, already in the cache
    v_new: torch.Tensor
    k_cache: torch.Tensor  # NaN outside the sequences' contexts
    v_cache: torch.Tensor
    meta: AttentionMetadata


def make_paged_batch(q_lens: list[int], seq_lens: list[int], block_size: int, dtype: torch.dtype,
                     num_heads: int = NUM_HEADS, pad: int = 0) -> PagedBatch:
    """Sequences on shuffled cache blocks. Block 0 is a NaN trash block that pads the block
    tables, so a kernel reading past a sequence's blocks produces NaN; `pad` padding tokens
    (slot -1) follow the real ones."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    ids = (torch.randperm(sum(blocks_per_seq)) + 1).tolist()
    shape = (len(ids) + 1, block_size, num_heads, HEAD_DIM)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    slots, k_new, v_new = [], [], []
    for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        table = torch.tensor([ids.pop() for _ in range(blocks_per_seq[i])], dtype=torch.long)
        block_tables[i, :len(table)] = table
        pos = torch.arange(seq_len)
        seq_slots = (table[pos // block_size] * block_size + pos % block_size).to(DEVICE)
        k, v = _rows(seq_len, num_heads, dtype), _rows(seq_len, num_heads, dtype)
        k_cache.view(-1, num_heads, HEAD_DIM)[seq_slots] = k
        v_cache.view(-1, num_heads, HEAD_DIM)[seq_slots] = v
        slots.append(seq_slots[seq_len - q_len:])
        k_new.append(k[seq_len - q_len:])
        v_new.append(v[seq_len - q_len:])
    slot_mapping = torch.cat(slots + [torch.full((pad,), -1, device=DEVICE)])
    starts = [0] + torch.tensor(q_lens).cumsum(0).tolist()
    meta = AttentionMetadata(
        slot_mapping=slot_mapping.long(), block_tables=block_tables.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_start_loc_host=starts, seq_lens_host=list(seq_lens))
    k_new.append(_rows(pad, num_heads, dtype))  # padding tokens carry junk K/V
    v_new.append(_rows(pad, num_heads, dtype))
    return PagedBatch(_rows(sum(q_lens) + pad, num_heads, dtype), torch.cat(k_new),
                      torch.cat(v_new), k_cache, v_cache, meta)


def _rows(n: int, num_heads: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(n, num_heads, HEAD_DIM, device=DEVICE, dtype=dtype)
