"""A graph step's input ids: row i takes prev[source[i]] where source[i] < num_prev (a
placeholder: the previous step's draw, read where the step graphs wrote it), else
own[source[i] - num_prev] (a token the host knew). One launch in place of a copy of the
previous draws into the step's buffer and a gather. Reference:
`engine.worker.layers.gather_tokens`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_options, pdl_prologue

BLOCK = 1024  # rows a program gathers (a decode step is one program)


@triton.jit
def _gather_tokens_kernel(prev_ptr, own_ptr, source_ptr, out_ptr, rows, num_prev,
                          BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < rows
    source = tl.load(source_ptr + offs, mask=ok, other=0)
    from_prev = source < num_prev
    prev = tl.load(prev_ptr + source, mask=ok & from_prev, other=0)
    own = tl.load(own_ptr + source - num_prev, mask=ok & ~from_prev, other=0)
    tl.store(out_ptr + offs, tl.where(from_prev, prev, own), mask=ok)


def gather_tokens(prev: torch.Tensor, own: torch.Tensor, source: torch.Tensor,
                  num_prev: int) -> torch.Tensor:
    """int64 prev [P], own [O], source [R] (each < num_prev indexing prev, else num_prev +
    an index of own) -> int64 [R]."""
    assert prev.dtype == own.dtype == source.dtype == torch.int64
    assert prev.is_contiguous() and own.is_contiguous() and source.is_contiguous()
    out = torch.empty_like(source)
    rows = source.numel()
    if rows:
        _gather_tokens_kernel[(triton.cdiv(rows, BLOCK),)](
            prev, own, source, out, rows, num_prev, BLOCK=BLOCK, num_warps=4,
            **pdl_options(source.device))
    return out
