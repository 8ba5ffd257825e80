"""Decode CUDA graphs: capture sizes (CPU) and graph == eager output (GPU only)."""
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cuda_graphs import capture_sizes


def test_capture_sizes_cover_every_batch():
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(30)[-1] == 30


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_graph_decode_equals_eager(tiny_checkpoint, dtype):
    rng = random.Random(0)
    prompts = [[rng.randrange(50256) for _ in range(rng.randint(1, 300))] for _ in range(13)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    results = []
    for eager in (True, False):
        llm = LLM(model=str(tiny_checkpoint), device="cuda", dtype=dtype, max_num_seqs=16,
                  enforce_eager=eager, num_kv_blocks=512)
        assert (llm.engine.runner.graphs is None) == eager
        results.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert results[0] == results[1]
