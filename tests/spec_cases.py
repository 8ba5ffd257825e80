"""What the speculative engine tests share: a CPU engine on a checkpoint, the requests they
compare with and without speculation, and the engine settings each proposer runs under."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

K = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
# logprobs keep a request from speculating: it decodes plainly beside the others
PLAIN_ROW = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)


def make_llm(checkpoint, **overrides) -> LLM:
    """An LLM on the CPU (float32, torch attention, 128 KV blocks) with `overrides`."""
    settings = dict(device="cpu", dtype="float32", num_kv_blocks=128,
                    attention_backend="torch")
    settings.update(overrides)
    return LLM(model=str(checkpoint), **settings)


def mixed_params(prompts) -> list[SamplingParams]:
    """Greedy for every prompt but the second, which decodes plainly beside them."""
    return [PLAIN_ROW if i == 1 else GREEDY for i in range(len(prompts))]


def assert_all_blocks_free(llm) -> None:
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks


# engine settings every proposer is checked under: prefix caching on and off, 7-token
# chunks, a block pool too small for the batch (preemption), no scheduling ahead
EACH_SETTING = pytest.mark.parametrize("overrides", [
    {},
    {"enable_prefix_caching": False},
    {"max_num_batched_tokens": 7},
    {"num_kv_blocks": 24, "block_size": 4, "max_num_batched_tokens": 32},
    {"async_scheduling": False},
], ids=["prefix-cache", "no-prefix-cache", "chunk-7", "preemption", "sync"])
