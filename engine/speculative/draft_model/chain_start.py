"""The start of every draft chain run, as one op: from each row's staged next token, its
position, its draft count and the drafts its verification accepted, every iteration's plan
and the first iteration's inputs:

    staged      next token s, its position b if no draft is accepted   (positions, next_tokens)
    verified    A of the row's last drafts d1..dk accepted              (num_accepted; 0 for a
                                                                         run the host stages)
    first       s @ p, p = b + A; where A = k, d_k @ p - 1 before it    (first_*)
    plan        iteration i at min(p + i, p + k - 1), slot -1 once the row has drawn its k

Where A = k the last run drew d_k without feeding it and the step that verified it skipped
the draft's follow pass, so nothing else writes the draft's KV at p - 1. The first
iteration's token rows are packed, each row's one or two, then padding (token 0 at 0, slot
-1) up to two a row. A row without drafts (padding) is one token 0 at position 0 that writes
nothing. `chain_start` is the reference of kernels/draft_chain_start.py (one launch);
`chain_start_op` picks.
"""
from __future__ import annotations

from collections.abc import Callable

import torch


def chain_start_op(attention_backend: str) -> Callable[..., None]:
    """The Triton kernel with the Triton backend (imported only then: CPU runs need no
    Triton), else the reference."""
    if attention_backend != "triton":
        return chain_start
    from kernels.draft_chain_start import draft_chain_start

    return draft_chain_start


def slots_at(block_tables: torch.Tensor, positions: torch.Tensor,
             block_size: int) -> torch.Tensor:
    """The cache slots of `positions` [rows, n] in each row's block table."""
    blocks = block_tables.gather(1, positions // block_size)
    return blocks * block_size + positions % block_size


def chain_start(positions: torch.Tensor, next_tokens: torch.Tensor,
                draft_counts: torch.Tensor, block_tables: torch.Tensor,
                last_drafts: torch.Tensor, num_accepted: torch.Tensor, block_size: int,
                plan_positions: torch.Tensor, plan_slots: torch.Tensor,
                plan_seq_lens: torch.Tensor, plan_drafted: torch.Tensor,
                first_tokens: torch.Tensor, first_positions: torch.Tensor,
                first_slots: torch.Tensor, first_query_starts: torch.Tensor,
                first_rows: torch.Tensor) -> None:
    """Per row r < R (R = len(positions)): b, s, k, its block table, its last drafts ([R,
    >= k]) and A. Writes the plan ([iterations, R]: int64 positions and slots, int32
    seq_lens, bool drafted) and the first iteration's packed [2R] int64 token ids,
    positions and slots, its [R + 1] int32 query starts and each row's own token row [R]
    (int64: where the row's draw reads its hidden state)."""
    rows, iterations = len(positions), plan_positions.shape[0]
    counts, accepted = draft_counts.long(), num_accepted.long()
    drafting = counts > 0
    first = torch.where(drafting, positions + accepted, 0)
    steps = torch.arange(iterations, device=first.device)[:, None]
    at = torch.minimum(first + steps, first + (counts - 1).clamp(min=0))
    drafted = steps < counts
    plan_positions.copy_(at)
    plan_slots.copy_(torch.where(drafted, slots_at(block_tables, at.t(), block_size).t(), -1))
    plan_seq_lens.copy_(at + 1)
    plan_drafted.copy_(drafted)

    lacks_last = drafting & (accepted == counts)  # feeds d_k before its next token
    own = torch.arange(rows, device=first.device) + lacks_last.cumsum(0)
    trash = 2 * rows  # where rows feeding one token put their absent first one
    before = torch.where(lacks_last, own - 1, trash)
    last_draft = last_drafts.gather(1, (counts - 1).clamp(min=0)[:, None]).squeeze(1)
    before_slots = slots_at(block_tables, (first - 1).clamp(min=0)[:, None], block_size)

    def packed(own_values: torch.Tensor, before_values: torch.Tensor,
               fill: int) -> torch.Tensor:
        out = own_values.new_full((trash + 1,), fill)
        return out.index_copy(0, own, own_values).index_copy(0, before, before_values)[:trash]

    first_tokens.copy_(packed(torch.where(drafting, next_tokens, 0), last_draft, 0))
    first_positions.copy_(packed(first, first - 1, 0))
    first_slots.copy_(packed(plan_slots[0], before_slots.squeeze(1), -1))
    first_query_starts.copy_(torch.cat([own.new_zeros(1), own + 1]))
    first_rows.copy_(own)
