"""The start of a draft chain run queued ahead, in one launch: every iteration's plan and
the first iteration's two token rows a sequence. Reference, with a diagram:
`engine.speculative.draft_model.chain_start.chain_start`.

One program holds every row (up to a few hundred): a handful of loads and stores a row, so
the launch is the whole cost.
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
def _draft_chain_start_kernel(staged_pos_ptr, staged_tok_ptr, counts_ptr, tables_ptr,
                              drafts_ptr, accepted_ptr, sampled_ptr, plan_pos_ptr,
                              plan_slot_ptr, plan_len_ptr, plan_drafted_ptr, first_tok_ptr,
                              first_pos_ptr, first_slot_ptr, rows, block_size, stride_table,
                              stride_drafts, ITERATIONS: tl.constexpr, BLOCK: tl.constexpr,
                              USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    r = tl.arange(0, BLOCK)
    ok = r < rows
    counts = tl.load(counts_ptr + r, mask=ok, other=0).to(tl.int64)
    drafting = counts > 0
    accepted = tl.load(accepted_ptr + r, mask=ok, other=0).to(tl.int64)
    staged = tl.load(staged_pos_ptr + r, mask=ok, other=0)
    first = tl.where(drafting, staged + accepted + 1, 1)
    table = tables_ptr + r * stride_table
    last_accepted = tl.load(drafts_ptr + r * stride_drafts + accepted - 1,
                            mask=ok & drafting & (accepted > 0), other=0)
    before = tl.where(accepted > 0, last_accepted,
                      tl.load(staged_tok_ptr + r, mask=ok, other=0))
    sampled = tl.load(sampled_ptr + r, mask=ok, other=0)
    tl.store(first_tok_ptr + 2 * r, tl.where(drafting, before, 0), mask=ok)
    tl.store(first_tok_ptr + 2 * r + 1, tl.where(drafting, sampled, 0), mask=ok)
    tl.store(first_pos_ptr + 2 * r, first - 1, mask=ok)
    tl.store(first_pos_ptr + 2 * r + 1, first, mask=ok)
    tl.store(first_slot_ptr + 2 * r,
             tl.where(drafting, _slot(table, first - 1, block_size, ok & drafting), -1), mask=ok)
    for i in tl.static_range(ITERATIONS):
        at = tl.minimum(first + i, first + tl.maximum(counts - 1, 0))
        drafted = i < counts
        slot = tl.where(drafted, _slot(table, at, block_size, ok & drafted), -1)
        tl.store(plan_pos_ptr + i * rows + r, at, mask=ok)
        tl.store(plan_slot_ptr + i * rows + r, slot, mask=ok)
        tl.store(plan_len_ptr + i * rows + r, (at + 1).to(tl.int32), mask=ok)
        tl.store(plan_drafted_ptr + i * rows + r, drafted.to(tl.int8), mask=ok)
        if i == 0:
            tl.store(first_slot_ptr + 2 * r + 1, slot, mask=ok)


def draft_chain_start(staged_positions: torch.Tensor, staged_tokens: torch.Tensor,
                      draft_counts: torch.Tensor, block_tables: torch.Tensor,
                      last_drafts: torch.Tensor, num_accepted: torch.Tensor,
                      sampled: torch.Tensor, block_size: int, plan_positions: torch.Tensor,
                      plan_slots: torch.Tensor, plan_seq_lens: torch.Tensor,
                      plan_drafted: torch.Tensor, first_tokens: torch.Tensor,
                      first_positions: torch.Tensor, first_slots: torch.Tensor) -> None:
    """engine.speculative.draft_model.chain_start.chain_start's arguments and writes."""
    iterations, rows = plan_positions.shape
    for t in (plan_positions, plan_slots, plan_seq_lens, plan_drafted, first_tokens,
              first_positions, first_slots, staged_positions, staged_tokens, draft_counts,
              num_accepted, sampled):
        assert t.is_contiguous()
    assert block_tables.stride(1) == 1 and last_drafts.stride(1) == 1
    assert plan_drafted.dtype == torch.bool and plan_seq_lens.dtype == torch.int32
    _draft_chain_start_kernel[(1,)](
        staged_positions, staged_tokens, draft_counts, block_tables, last_drafts, num_accepted,
        sampled, plan_positions, plan_slots, plan_seq_lens, plan_drafted.view(torch.int8),
        first_tokens, first_positions, first_slots, rows, block_size, block_tables.stride(0),
        last_drafts.stride(0), ITERATIONS=iterations,
        BLOCK=max(16, triton.next_power_of_2(rows)), **pdl_options(staged_positions.device))
