"""The start of a draft chain run queued ahead (DraftChainGraphs.run_ahead), as one op: from
the last run's rows and what their verification accepted, every iteration's plan and the
first iteration's inputs, two token rows a sequence:

    last run    row fed t @q, drew d1..dk                      (staged positions, tokens)
    verified    A drafts accepted, then s                       (num_accepted, sampled)
    first       [token @ p - 1, s @ p], p = q + A + 1           (first_tokens, _positions,
                (t if A = 0, else d_A: when A = k the draft's    _slots; both rows write
                 first KV of d_k; A < k: a rewrite of its own)   their KV)
    plan        iteration i at min(p + i, p + k - 1), slot -1 once the row has drawn its k

A row without drafts (padding) sits at positions 0 and 1 and writes nothing. `chain_start` is
the reference of kernels/draft_chain_start.py (one launch); `chain_start_op` picks.
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


def chain_plan(first: torch.Tensor, block_tables: torch.Tensor, draft_counts: torch.Tensor,
         iterations: int, block_size: int) -> tuple[torch.Tensor, ...]:
    """A chain run's plan from each row's first position, block table and draft count:
    [iterations, rows] int64 positions and slots (-1 once the row has drawn its count), int32
    lengths, bool drafted (`ChainPlan`'s fields)."""
    steps = torch.arange(iterations, device=first.device)[:, None]
    counts = draft_counts.long()
    at = torch.minimum(first + steps, first + (counts - 1).clamp(min=0))
    drafted = steps < counts
    slots = slots_at(block_tables, at.t(), block_size).t().contiguous()
    return at, torch.where(drafted, slots, -1), (at + 1).int(), drafted


def slots_at(block_tables: torch.Tensor, positions: torch.Tensor,
             block_size: int) -> torch.Tensor:
    """The cache slots of `positions` [rows, n] in each row's block table."""
    blocks = block_tables.gather(1, positions // block_size)
    return blocks * block_size + positions % block_size


def chain_start(staged_positions: torch.Tensor, staged_tokens: torch.Tensor,
                draft_counts: torch.Tensor, block_tables: torch.Tensor,
                last_drafts: torch.Tensor, num_accepted: torch.Tensor, sampled: torch.Tensor,
                block_size: int, plan_positions: torch.Tensor, plan_slots: torch.Tensor,
                plan_seq_lens: torch.Tensor, plan_drafted: torch.Tensor,
                first_tokens: torch.Tensor, first_positions: torch.Tensor,
                first_slots: torch.Tensor) -> None:
    """Per row r < R (R = plan_positions.shape[1]): the last run's position and token,
    draft count, block table and drafts ([R, >= iterations]), and the verification's
    accepted count and sampled token. Writes the plan ([iterations, R]: int64 positions and
    slots, int32 seq_lens, bool drafted) and the first iteration's [2R] int64 inputs."""
    drafting = draft_counts > 0
    accepted = num_accepted.long()
    first = torch.where(drafting, staged_positions + accepted + 1, 1)
    for out, value in zip((plan_positions, plan_slots, plan_seq_lens, plan_drafted),
                          chain_plan(first, block_tables, draft_counts,
                                     plan_positions.shape[0], block_size)):
        out.copy_(value)
    last_accepted = last_drafts.gather(1, (accepted - 1).clamp(min=0)[:, None]).squeeze(1)
    before = torch.where(accepted > 0, last_accepted, staged_tokens)
    before_slots = slots_at(block_tables, (first - 1)[:, None], block_size).squeeze(1)
    first_tokens.copy_(_pairs(torch.where(drafting, before, 0), torch.where(drafting, sampled, 0)))
    first_positions.copy_(_pairs(first - 1, first))
    first_slots.copy_(_pairs(torch.where(drafting, before_slots, -1), plan_slots[0]))


def _pairs(even: torch.Tensor, odd: torch.Tensor) -> torch.Tensor:
    return torch.stack([even, odd], dim=1).view(-1)
