"""Verification of speculative drafts: which of a row's k drafts the target accepts, and the
token after them, in one batched call on the target's logits for the k + 1 positions.

    position      0     1     2  ..  k-1      k
    draft         d0    d1    d2 ..  d(k-1)   -
    target        p0    p1    p2 ..  p(k-1)   pk       (softmax(logits / T) per position)
    output        d0    d1    x2                       2 accepted, x2 the correction
                  d0    d1    d2 ..  d(k-1)   xk       all accepted, xk the bonus drawn from pk

Every row draws position i with its own seed, seeds[row, i]: the seed the plain sampler
would use for that output position (`Sampler.draw_inputs`: (seed, tokens generated so far)
for a seeded request), so a seeded request is reproducible whatever its batch.

Greedy rows (T = 0) accept while the draft equals the argmax; the argmax follows.

Sampled rows, one-hot q (n-gram, oracle; draft_probs None): the plain sampler's Gumbel race
x_i = argmax(logits_i / T + G(seeds_i)) decides. The draft is accepted when x_i == d_i, which
happens with probability p_i(d_i) = min(1, p/q); otherwise x_i is the correction, and given
x_i != d_i it is distributed as normalize(max(p_i - onehot(d_i), 0)). That is rejection
sampling exactly, with the accept test and the resampling coupled through one race, and the
tokens are the very ones the plain sampler would draw: a seeded request's output is the same
with speculation on or off.

Sampled rows, dense q (a draft model): accept d_i when u_i q_i(d_i) < p_i(d_i), u_i uniform;
on rejection draw from normalize(max(p_i - q_i, 0)) by a Gumbel race on its log; the bonus is
the plain draw from p_k. The two streams come from one hash (`layers.hashed_uniform`) at
different columns of the position's seed: the race reads columns 0 .. V-1 (the plain
sampler's noise), the accept uniform column 2^32 - 1, which no vocabulary reaches. The hash is
a bijection of (column xor seed), so the inputs never coincide and the streams are
independent. The uniform has 23 bits: each accept probability is off by at most 2^-24.
q must be the distribution the draft sampled d_i from (at the request's temperature).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from engine.worker import layers

ACCEPT_COLUMN = layers.MASK32  # the hash column of the accept uniforms: past any vocabulary
NO_TOKEN = -1  # pads token_ids after a row's correction or bonus token


@dataclass(frozen=True)
class Verified:
    num_accepted: torch.Tensor  # [R] int64: leading drafts accepted
    token_ids: torch.Tensor  # [R, k + 1] int64: accepted drafts, then the next token; NO_TOKEN

    @property
    def num_emitted(self) -> torch.Tensor:
        """Tokens each row gains: the accepted drafts plus the correction or bonus."""
        return self.num_accepted + 1


def accept_uniforms(seeds: torch.Tensor) -> torch.Tensor:
    """int64 seeds of any shape -> float32 uniforms in (0, 1), independent of the seeds'
    Gumbel noise over the vocabulary."""
    return layers.hashed_uniform(seeds, seeds.new_tensor(ACCEPT_COLUMN))


def verify(target_logits: torch.Tensor, draft_token_ids: torch.Tensor,
           num_drafts: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
           draft_probs: torch.Tensor | None = None,
           draw: Callable[..., torch.Tensor] = layers.sample) -> Verified:
    """target_logits [R, k + 1, V]; draft_token_ids [R, k] int64 (a row's first num_drafts
    count; any padding after them, NO_TOKEN included, is ignored); num_drafts [R] int64 in
    [0, k]; temperature [R] (0: greedy); seeds [R, k + 1] int64 >= 0, one per position;
    draft_probs [R, k, V] or None (one-hot drafts); draw: the device's Gumbel-max op
    (`Ops.sample`)."""
    rows, width, vocab = target_logits.shape
    logits = target_logits.float()
    temperature = temperature.float()
    plain = draw(logits.reshape(-1, vocab), temperature.repeat_interleave(width),
                 seeds.reshape(-1)).view(rows, width)
    if draft_probs is None or width == 1:
        return accept_drawn(plain, draft_token_ids, num_drafts)
    is_draft = torch.arange(width - 1, device=logits.device) < num_drafts[:, None]
    plain_accepts = (plain[:, :-1] == draft_token_ids) & is_draft
    greedy = temperature == 0
    accepts = torch.where(greedy[:, None], plain_accepts,
                          _dense_accepts(logits, draft_token_ids, draft_probs, temperature,
                                         seeds) & is_draft)
    num_accepted = _leading_true(accepts)
    rejected = (num_accepted < num_drafts) & ~greedy
    next_token = _draw_after_run(logits, draft_probs, temperature, seeds, num_accepted,
                                 rejected, draw)
    tokens = torch.cat([draft_token_ids, next_token[:, None]], dim=1)
    tokens = tokens.scatter(1, num_accepted[:, None], next_token[:, None])
    return Verified(num_accepted, _mask_after(tokens, num_accepted))


def accept_drawn(plain: torch.Tensor, draft_token_ids: torch.Tensor,
                 num_drafts: torch.Tensor) -> Verified:
    """One-hot drafts judged against the plain draws of their positions (plain [R, k + 1]:
    what the sampler drew at each position, e.g. inside a CUDA graph): accepted while equal,
    then the draw at the first mismatch, or the bonus draw after all of them."""
    is_draft = torch.arange(plain.shape[1] - 1, device=plain.device) < num_drafts[:, None]
    num_accepted = _leading_true((plain[:, :-1] == draft_token_ids) & is_draft)
    return Verified(num_accepted, _mask_after(plain, num_accepted))


def _probs(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """softmax(logits / T) per row (rows of logits lead; T = 0 rows use T = 1: unused)."""
    scale = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    return torch.softmax(logits / scale.view(-1, *[1] * (logits.dim() - 1)), dim=-1)


def _dense_accepts(logits: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor,
                   temperature: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """u q(d) < p(d) per draft position: true with probability min(1, p(d) / q(d))."""
    index = drafts.clamp(min=0)[..., None]  # padding past a row's drafts may be negative
    p = _probs(logits[:, :-1], temperature).gather(2, index).squeeze(2)
    q = draft_probs.float().gather(2, index).squeeze(2)
    return accept_uniforms(seeds[:, :-1]) * q < p


def _draw_after_run(logits: torch.Tensor, draft_probs: torch.Tensor, temperature: torch.Tensor,
                    seeds: torch.Tensor, num_accepted: torch.Tensor, rejected: torch.Tensor,
                    draw: Callable[..., torch.Tensor]) -> torch.Tensor:
    """The token at position num_accepted: from the residual max(p - q, 0) where a draft was
    rejected, else the plain draw from the target (the bonus, or greedy's argmax)."""
    rows = torch.arange(logits.shape[0], device=logits.device)
    logits_at = logits[rows, num_accepted]
    q_at = draft_probs.float()[rows, num_accepted.clamp(max=draft_probs.shape[1] - 1)]
    p_at = _probs(logits_at, temperature)
    residual = (p_at - q_at).clamp(min=0)
    # p == q up to rounding leaves no mass; such a row is (almost) never rejected: draw from p
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_at)
    scores = torch.where(rejected[:, None], residual.log(), logits_at)
    scale = torch.where(rejected, torch.ones_like(temperature), temperature)
    return draw(scores, scale, seeds[rows, num_accepted])


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """[R, k] bool -> [R] int64: how many leading entries of each row are true."""
    return mask.long().cumprod(dim=1).sum(dim=1)


def _mask_after(tokens: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    return torch.where(positions <= num_accepted[:, None], tokens, NO_TOKEN)
