"""A step with drafts, as the sampler sees it, and its verification.

A sequence with d drafts samples at d + 1 positions, position i drawing as output index
num_output_tokens + i would (`Sampler.draw_inputs`). `accept_drawn` keeps drafts while they
equal the draws; the draw at the first mismatch, or after the last draft, is the sampled token.

    sequences   A (2 drafts)          B (none)     C (1 draft)
    rows        A+0  A+1  A+2         B+0          C+0  C+1
    plain       [[A+0 A+1 A+2]        [B+0 B+0 B+0]  [C+0 C+1 C+1]]    (padding repeats)
    sampled     A: plain[num_accepted]   B: B+0   C: plain[num_accepted]

    position      0     1     2  ..  k-1      k
    draft         d0    d1    d2 ..  d(k-1)   -
    output        d0    d1    x2                       2 accepted, x2 the correction
                  d0    d1    d2 ..  d(k-1)   xk       all accepted, xk the bonus

Drafts are one-hot, so the plain draws decide everything. For a sampled row the draw is the
Gumbel race x_i = argmax(logits_i / T + G(seed_i)): x_i == d_i with probability
p_i(d_i) = min(1, p/q) for one-hot q; else x_i, the correction, is distributed as
normalize(max(p_i - onehot(d_i), 0)). That is exact rejection sampling, and a seeded
request's output is the same with speculation on or off.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from engine.core.batch import ScheduledSequence
from engine.worker.inputs import upload
from engine.worker.sampler import NO_TOKEN, SamplerOutput


@dataclass(frozen=True)
class Verified:
    num_accepted: torch.Tensor  # [R] int64: leading drafts accepted
    token_ids: torch.Tensor  # [R, k + 1] int64: accepted drafts, then the next token; NO_TOKEN


def accept_drawn(plain: torch.Tensor, draft_token_ids: torch.Tensor,
                 num_drafts: torch.Tensor) -> Verified:
    """One-hot drafts ([R, k], any padding past a row's num_drafts ignored) judged against
    the plain draws of their positions (plain [R, k + 1]): accepted while equal, then the
    draw at the first mismatch, or the bonus draw after all of them."""
    is_draft = torch.arange(plain.shape[1] - 1, device=plain.device) < num_drafts[:, None]
    matches = (plain[:, :-1] == draft_token_ids) & is_draft
    num_accepted = matches.long().cumprod(dim=1).sum(dim=1)
    positions = torch.arange(plain.shape[1], device=plain.device)
    return Verified(num_accepted, torch.where(positions <= num_accepted[:, None], plain,
                                              NO_TOKEN))


def position_rows(seqs: list[ScheduledSequence]) -> list[ScheduledSequence]:
    """One sampling row per position each sequence samples at."""
    rows = []
    for seq in seqs:
        rows.append(seq)
        rows += [replace(seq, num_output_tokens=seq.num_output_tokens + i)
                 for i in range(1, seq.num_drafts + 1)]
    return rows


def draft_token_rows(seqs: list[ScheduledSequence], sample_indices: np.ndarray,
                     width: int) -> tuple[np.ndarray, np.ndarray]:
    """Where the drafts of `seqs` (sampling sequences, in order) go: each draft's token row in
    the step (`sample_indices` holds each sequence's last num_drafts + 1 rows, the first of
    them its last known token's) and its index in the flattened [len(seqs), width] drafts."""
    num_drafts = np.array([s.num_drafts for s in seqs], dtype=np.int64)
    counts = num_drafts + 1
    is_draft = np.ones(int(counts.sum()), dtype=bool)
    is_draft[np.cumsum(counts) - counts] = False
    return sample_indices[is_draft], np.flatnonzero(np.arange(width) < num_drafts[:, None])


def host_drafts(seqs: list[ScheduledSequence], device: torch.device) -> torch.Tensor:
    """[len(seqs), max drafts] int64 on `device`: each sequence's drafts as the scheduler
    holds them (a host proposer's), NO_TOKEN past its own."""
    width = max(s.num_drafts for s in seqs)
    drafts = np.full((len(seqs), width), NO_TOKEN, dtype=np.int64)
    for row, seq in enumerate(seqs):
        if seq.num_drafts:
            drafts[row, :seq.num_drafts] = seq.token_ids[-seq.num_drafts:]
    return upload(drafts, torch.int64, device)


def verify_drafts(sampled: SamplerOutput, seqs: list[ScheduledSequence],
                  drafts: torch.Tensor) -> SamplerOutput:
    """The per-position draws of `seqs` (sampling sequences, in order) and their drafts
    ([len(seqs), max drafts] on the device, NO_TOKEN past a sequence's own) -> one sampled
    token per sequence, with the drafts it accepted."""
    num_drafts = np.array([s.num_drafts for s in seqs], dtype=np.int64)
    first_row = np.cumsum(num_drafts + 1) - num_drafts - 1
    width = int(num_drafts.max()) + 1
    gather = first_row[:, None] + np.minimum(np.arange(width), num_drafts[:, None])
    device = sampled.token_ids.device
    plain = sampled.token_ids[upload(gather, torch.int64, device)]
    verified = accept_drawn(plain, drafts, upload(num_drafts, torch.int64, device))
    tokens = verified.token_ids.gather(1, verified.num_accepted[:, None]).squeeze(1)
    row_of_position = np.repeat(np.arange(len(seqs)), num_drafts + 1)
    return replace(sampled, token_ids=tokens, verified_token_ids=verified.token_ids,
                   logprob_rows=row_of_position[sampled.logprob_rows].tolist())
