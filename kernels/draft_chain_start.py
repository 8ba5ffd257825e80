"""The start of a draft chain run, in one launch: every iteration's plan and the first
iteration's packed token rows. Reference, with a diagram:
`engine.speculative.draft_model.chain_start.chain_start`.

One program holds every row (up to a few hundred): a handful of loads and stores a row, so
the launch is the whole cost. The rows' token rows are disjoint (a row's own at
r + its lacking rows so far, the one before it, the padding after them all), so no store
overwrites another and no barrier is needed.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_options, pdl_prologue


@triton.jit
def _slot(table_ptr, positions, block_size, mask):
    block = tl.load(table_ptr + positions // block_size, mask=mask, other=0).to(tl.int64)
    return block * block_size + positions % block_size


@triton.jit
def _draft_chain_start_kernel(pos_ptr, next_ptr, counts_ptr, tables_ptr, drafts_ptr,
                              accepted_ptr, plan_pos_ptr, plan_slot_ptr, plan_len_ptr,
                              plan_drafted_ptr, first_tok_ptr, first_pos_ptr, first_slot_ptr,
                              first_start_ptr, first_row_ptr, rows, block_size, stride_table,
                              stride_drafts, ITERATIONS: tl.constexpr, BLOCK: tl.constexpr,
                              USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    r = tl.arange(0, BLOCK)
    ok = r < rows
    counts = tl.load(counts_ptr + r, mask=ok, other=0).to(tl.int64)
    drafting = counts > 0
    accepted = tl.load(accepted_ptr + r, mask=ok, other=0).to(tl.int64)
    first = tl.where(drafting, tl.load(pos_ptr + r, mask=ok, other=0) + accepted, 0)
    table = tables_ptr + r * stride_table
    own_slot = tl.full([BLOCK], -1, tl.int64)
    for i in tl.static_range(ITERATIONS):
        at = tl.minimum(first + i, first + tl.maximum(counts - 1, 0))
        drafted = i < counts
        slot = tl.where(drafted, _slot(table, at, block_size, ok & drafted), -1)
        tl.store(plan_pos_ptr + i * rows + r, at, mask=ok)
        tl.store(plan_slot_ptr + i * rows + r, slot, mask=ok)
        tl.store(plan_len_ptr + i * rows + r, (at + 1).to(tl.int32), mask=ok)
        tl.store(plan_drafted_ptr + i * rows + r, drafted.to(tl.int8), mask=ok)
        if i == 0:
            own_slot = slot

    lacks_last = drafting & (accepted == counts)
    lacking = lacks_last.to(tl.int32)
    own = r + tl.cumsum(lacking, axis=0).to(tl.int64)
    next_token = tl.load(next_ptr + r, mask=ok & drafting, other=0)
    tl.store(first_tok_ptr + own, next_token, mask=ok)
    tl.store(first_pos_ptr + own, first, mask=ok)
    tl.store(first_slot_ptr + own, own_slot, mask=ok)
    last_draft = tl.load(drafts_ptr + r * stride_drafts + counts - 1, mask=lacks_last, other=0)
    tl.store(first_tok_ptr + own - 1, last_draft, mask=lacks_last)
    tl.store(first_pos_ptr + own - 1, first - 1, mask=lacks_last)
    tl.store(first_slot_ptr + own - 1, _slot(table, first - 1, block_size, lacks_last),
             mask=lacks_last)
    pad = rows + tl.sum(lacking, axis=0) + r
    tail = ok & (pad < 2 * rows)
    tl.store(first_tok_ptr + pad, tl.zeros([BLOCK], tl.int64), mask=tail)
    tl.store(first_pos_ptr + pad, tl.zeros([BLOCK], tl.int64), mask=tail)
    tl.store(first_slot_ptr + pad, tl.full([BLOCK], -1, tl.int64), mask=tail)
    tl.store(first_start_ptr + r + 1, (own + 1).to(tl.int32), mask=ok)
    tl.store(first_start_ptr + r, tl.zeros([BLOCK], tl.int32), mask=r == 0)
    tl.store(first_row_ptr + r, own, mask=ok)


def draft_chain_start(positions: torch.Tensor, next_tokens: torch.Tensor,
                      draft_counts: torch.Tensor, block_tables: torch.Tensor,
                      last_drafts: torch.Tensor, num_accepted: torch.Tensor, block_size: int,
                      plan_positions: torch.Tensor, plan_slots: torch.Tensor,
                      plan_seq_lens: torch.Tensor, plan_drafted: torch.Tensor,
                      first_tokens: torch.Tensor, first_positions: torch.Tensor,
                      first_slots: torch.Tensor, first_query_starts: torch.Tensor,
                      first_rows: torch.Tensor) -> None:
    """engine.speculative.draft_model.chain_start.chain_start's arguments and writes."""
    iterations, rows = plan_positions.shape
    for t in (positions, next_tokens, draft_counts, num_accepted, plan_positions, plan_slots,
              plan_seq_lens, plan_drafted, first_tokens, first_positions, first_slots,
              first_query_starts, first_rows):
        assert t.is_contiguous()
    assert block_tables.stride(1) == 1 and last_drafts.stride(1) == 1
    assert plan_drafted.dtype == torch.bool and plan_seq_lens.dtype == torch.int32
    assert first_query_starts.dtype == torch.int32
    _draft_chain_start_kernel[(1,)](
        positions, next_tokens, draft_counts, block_tables, last_drafts, num_accepted,
        plan_positions, plan_slots, plan_seq_lens, plan_drafted.view(torch.int8),
        first_tokens, first_positions, first_slots, first_query_starts, first_rows, rows,
        block_size, block_tables.stride(0), last_drafts.stride(0), ITERATIONS=iterations,
        BLOCK=max(16, triton.next_power_of_2(rows)), **pdl_options(positions.device))
