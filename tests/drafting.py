"""Verification as a step does it, for tests that hold logits rather than a runner."""
from __future__ import annotations

import torch

from engine.speculative.verify import Verified, accept_drawn
from engine.worker import layers


def verify_one_hot(logits: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor,
                   temperature: torch.Tensor, seeds: torch.Tensor) -> Verified:
    """logits [R, k + 1, V], drafts [R, k]: the plain draw at every position (the
    sampler's, each with its position's seed [R, k + 1]), then `accept_drawn`."""
    rows, width, vocab = logits.shape
    plain = layers.sample(logits.reshape(-1, vocab).float(),
                          temperature.float().repeat_interleave(width),
                          seeds.reshape(-1)).view(rows, width)
    return accept_drawn(plain, drafts, num_drafts)
