"""Row argmax of the logits for greedy decoding, in one launch.

torch's argmax reduces a 50257-wide row in one thread block (about 14 us on an H100 at batch
1, more than the whole LayerNorm of a step). Here each row is cut into CHUNK-wide pieces:

    row r:  | chunk 0 | chunk 1 | ... | chunk 12 |    one program each: (max, first index)
                 └─────────┴── partials ──┘          the last to arrive (arrival counter)
                                                     picks the max, lowest index on ties

As torch.argmax: the first index of the maximum, NaN counts as the largest value (a row
holding both NaN and +inf may give the first of either). Reference: `engine.layers.argmax`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.arrival_counters import arrive_last, counters_for, reset_counter
from kernels.pdl import pdl_options, pdl_prologue

CHUNK = 4096
NO_INDEX = tl.constexpr(2 ** 31 - 1)  # above any index: loses every min


@triton.jit
def _argmax_kernel(x_ptr, best_ptr, index_ptr, out_ptr, counter_ptr, V, stride_row,
                   CHUNK: tl.constexpr, CHUNKS_POW2: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    num_chunks = tl.num_programs(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_row + offs, mask=offs < V,
                other=-float("inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)  # NaN ranks first
    best = tl.max(x, axis=0)
    index = tl.min(tl.where((x == best) & (offs < V), offs, NO_INDEX), axis=0)
    tl.store(best_ptr + row * num_chunks + chunk, best)
    tl.store(index_ptr + row * num_chunks + chunk, index)
    if arrive_last(counter_ptr + row, num_chunks):
        chunks = tl.arange(0, CHUNKS_POW2)
        ok = chunks < num_chunks
        bests = tl.load(best_ptr + row * num_chunks + chunks, mask=ok, other=-float("inf"),
                        cache_modifier=".cg")
        indices = tl.load(index_ptr + row * num_chunks + chunks, mask=ok, other=NO_INDEX,
                          cache_modifier=".cg")
        top = tl.max(bests, axis=0)
        reset_counter(counter_ptr + row)
        tl.store(out_ptr + row, tl.min(tl.where(bests == top, indices, NO_INDEX), axis=0))


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> int64 [B], the index of each row's maximum."""
    assert logits.dim() == 2 and logits.stride(1) == 1
    rows, vocab = logits.shape
    if rows == 0 or vocab == 0:
        return torch.zeros(rows, dtype=torch.int64, device=logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)  # every row is written
    chunks = triton.cdiv(vocab, CHUNK)
    best = torch.empty((rows, chunks), dtype=torch.float32, device=logits.device)
    index = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    _argmax_kernel[(rows, chunks)](logits, best, index, out, counters_for(logits.device, rows),
                                   vocab, logits.stride(0), CHUNK=CHUNK,
                                   CHUNKS_POW2=triton.next_power_of_2(chunks), num_warps=8,
                                   **pdl_options(logits.device))
    return out
