"""The prompts the speculative engine tests compare on, and their output without
speculation (computed once per module)."""
from __future__ import annotations

import random

import pytest

from engine import SamplingParams
from spec_cases import make_llm, mixed_params


@pytest.fixture(scope="module")
def prompts():
    """Prompts that restate a passage (the n-gram proposer finds matches), and one that
    does not."""
    rng = random.Random(3)
    passages = [[rng.randrange(50256) for _ in range(n)] for n in (3, 6, 9, 5)]
    return [p * 3 for p in passages] + [[rng.randrange(50256) for _ in range(21)]]


@pytest.fixture(scope="module")
def plain_greedy(tiny_checkpoint, prompts):
    outputs = make_llm(tiny_checkpoint).generate(prompts, mixed_params(prompts), use_tqdm=False)
    return [o.token_ids for o in outputs]


@pytest.fixture(scope="module")
def seeded(tiny_checkpoint, prompts):
    """Seeded sampled requests (half with top-k) on three prompts, and their plain output."""
    params = [SamplingParams(temperature=0.9, top_k=50 if i % 2 else 0, seed=10 + i,
                             max_tokens=10, ignore_eos=True) for i in range(3)]
    plain = make_llm(tiny_checkpoint).generate(prompts[:3], params, use_tqdm=False)
    return params, [o.token_ids for o in plain]
