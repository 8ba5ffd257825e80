"""The model with each block in one launch at one and two decode rows (kernels/decode_layer.py)
generates what it generates op by op: greedy and sampled, through CUDA graphs and eagerly.
Startup takes one launch at the row counts where timing both ways found it faster (cached),
unless GPT2_SERVE_DECODE_LAYER forces it on or off."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import LLM, SamplingParams
from engine.worker.attention import TorchAttention
from engine.worker.layers import TORCH_OPS
from engine.worker.models.gpt2 import GPT2Config
from engine.worker.one_launch_blocks import (CONTEXT, DecodeStep, block_count, one_launch_rows,
                                             random_blocks, rows_where_one_launch_wins)
from engine.worker.startup import StartupCache
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


TINY = GPT2Config(50257, 1024, 64, 2, 4, 256, 1e-5)
MEASURED = (1, {1: (24.0, 22.0), 2: (30.0, 31.0)})  # one launch wins at one row only


def _measure_counting(monkeypatch, result):
    import engine.worker.triton_ops as backend

    calls = []
    monkeypatch.setattr(backend, "one_launch_rows", lambda *args: calls.append(args) or result)
    return backend, calls


@pytest.mark.parametrize("result,rows", [(MEASURED, 1), ((0, {1: (24.0, 25.0)}), 0),
                                         ((2, {1: (24.0, 22.0), 2: (30.0, 29.0)}), 2)])
def test_startup_takes_one_launch_where_it_was_measured_faster(tmp_path, monkeypatch, result,
                                                               rows):
    monkeypatch.delenv("GPT2_SERVE_DECODE_LAYER", raising=False)
    backend, calls = _measure_counting(monkeypatch, result)
    cache = StartupCache(tmp_path)
    for _ in range(2):  # the second start reads the answer from the cache
        ops = backend.measured_one_launch_blocks(backend.triton_ops(), TINY, torch.float16,
                                                 torch.device("cpu"), cache, None, 16)
        assert ops.decode_block_rows == rows
        assert ops.decode_block is (backend.decode_block if rows else None)
    assert len(calls) == 1
    assert calls[0][0].decode_block is backend.decode_block  # what it timed against op by op
    backend.measured_one_launch_blocks(backend.triton_ops(), TINY, torch.float16,
                                       torch.device("cpu"), cache, "int8", 16)
    assert len(calls) == 2  # another key: 8-bit weights are timed apart


def test_a_timing_that_fails_leaves_blocks_op_by_op_and_stores_nothing(tmp_path, monkeypatch,
                                                                       caplog):
    monkeypatch.delenv("GPT2_SERVE_DECODE_LAYER", raising=False)
    import engine.worker.triton_ops as backend

    def fail(*args):
        raise RuntimeError("out of resources")

    monkeypatch.setattr(backend, "one_launch_rows", fail)
    cache = StartupCache(tmp_path)
    ops = backend.measured_one_launch_blocks(backend.triton_ops(), TINY, torch.float16,
                                             torch.device("cpu"), cache, None, 16)
    assert (ops.decode_block, ops.decode_block_rows) == (None, 0)
    assert "could not time one launch" in caplog.text and not list(tmp_path.iterdir())


@pytest.mark.parametrize("flag,rows", [("1", decode_layer.MAX_ROWS), ("0", 0)])
def test_the_environment_forces_the_choice_without_timing(tmp_path, monkeypatch, flag, rows):
    monkeypatch.setenv("GPT2_SERVE_DECODE_LAYER", flag)
    backend, calls = _measure_counting(monkeypatch, MEASURED)
    ops = backend.measured_one_launch_blocks(backend.triton_ops(), TINY, torch.float16,
                                             torch.device("cpu"), StartupCache(tmp_path), None,
                                             16)
    assert (ops.decode_block_rows, bool(ops.decode_block), calls) == (rows, bool(rows), [])
    monkeypatch.setenv("GPT2_SERVE_DECODE_LAYER", "yes")
    with pytest.raises(ValueError, match="GPT2_SERVE_DECODE_LAYER='yes'"):
        backend.triton_ops()


def test_rows_stop_at_the_first_count_where_one_launch_loses():
    asked = []

    def time_at(rows):
        asked.append(rows)
        return {1: (10.0, 9.0), 2: (12.0, 12.0), 3: (14.0, 13.0)}[rows]

    assert rows_where_one_launch_wins(time_at, 3) == (1, {1: (10.0, 9.0), 2: (12.0, 12.0)})
    assert asked == [1, 2]
    assert rows_where_one_launch_wins(lambda rows: (5.0, 4.0), 2)[0] == 2


def test_the_timed_blocks_fill_three_l2_caches_within_the_model():
    xl = GPT2Config(50257, 1024, 1600, 48, 25, 6400, 1e-5)  # a block: 61 MB at 16 bits
    assert block_count(xl, torch.float16, None, 50 << 20) == 3
    assert block_count(xl, torch.float16, "int8", 50 << 20) == 6
    assert block_count(TINY, torch.float16, None, 50 << 20) == 2  # the model's two layers


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_the_timed_step_stores_each_rows_new_kv_at_its_last_position(quantization):
    """The step timed at startup is a real decode step: run op by op on the reference ops, it
    writes each row's K/V at position CONTEXT - 1 of its own blocks and nowhere else."""
    cpu = torch.device("cpu")
    blocks = random_blocks(TORCH_OPS, TorchAttention(), TINY, torch.float32, cpu,
                           quantization, 2)
    step = DecodeStep(TINY, 2, 2, torch.float32, cpu, 16)
    before = [tuple(c.clone() for c in cache) for cache in step.caches]
    step.run(blocks, TORCH_OPS, one_launch=False)
    per_seq = CONTEXT // 16
    for cache, old in zip(step.caches, before):
        for new_c, old_c in zip(cache, old):
            changed = (new_c != old_c).flatten(2).any(-1).nonzero().tolist()
            assert changed == [[row * per_seq + per_seq - 1, 15] for row in range(2)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_startup_times_both_ways_on_the_gpu(quantization):
    from engine.worker.triton_ops import TritonAttention, decode_block, triton_ops

    ops = dataclasses.replace(triton_ops(), decode_block=decode_block)
    rows, times = one_launch_rows(ops, TritonAttention(), TINY, decode_layer.MAX_ROWS,
                                  torch.float16, torch.device("cuda"), quantization, 16)
    assert 0 <= rows <= decode_layer.MAX_ROWS
    assert list(times) == list(range(1, min(rows + 1, decode_layer.MAX_ROWS) + 1))
    assert all(0 < t < 1e4 for pair in times.values() for t in pair)
