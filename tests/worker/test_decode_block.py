"""The model with each block in one launch at one and two decode rows (GPT2_SERVE_DECODE_LAYER=1,
kernels/decode_layer.py) generates what it generates op by op: greedy and sampled, through
CUDA graphs and eagerly."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from kernels import decode_layer


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_one_launch_blocks_generate_as_op_by_op(tiny_checkpoint, monkeypatch, enforce_eager):
    prompts = [[11, 22, 33, 44] * 8, [5] * 40]
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=3, max_tokens=40, ignore_eos=True)]
    calls = []
    launch = decode_layer.decode_layer
    monkeypatch.setattr(decode_layer, "decode_layer",
                        lambda *a, **kw: calls.append(1) or launch(*a, **kw))
    results = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("GPT2_SERVE_DECODE_LAYER", flag)
        llm = LLM(model=str(tiny_checkpoint), device="cuda", dtype="float32", max_num_seqs=2,
                  enforce_eager=enforce_eager, num_kv_blocks=256)
        results[flag] = [[o.token_ids for o in llm.generate([p], sp, use_tqdm=False)]
                         for p in prompts for sp in params]
        results[flag].append([o.token_ids for o in llm.generate(prompts, params[0],
                                                                 use_tqdm=False)])
        if flag == "1":
            assert calls, "no block ran in one launch"
    assert results["1"] == results["0"]
