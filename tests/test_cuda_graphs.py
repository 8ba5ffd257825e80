"""Decode CUDA graphs: capture sizes (CPU) and graph == eager output (GPU only)."""
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.worker.cuda_graphs import DecodeGraphs, MixedGraphs, capture_sizes, mixed_capture_sizes


def test_capture_sizes_cover_every_batch():
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(30)[-1] == 30


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=0.8),
                                    dict(temperature=0.8, top_k=40)],
                         ids=["greedy", "temperature", "top-k"])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_graph_decode_equals_eager(tiny_checkpoint, dtype, params):
    """Greedy, drawn at a temperature (the graph's captured draw and the eager sampler hash
    the same noise from the same seeds), or with top-k (the torch sampler on the graph's
    model-dtype logits, widened)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(50256) for _ in range(rng.randint(1, 300))] for _ in range(13)]
    params = SamplingParams(max_tokens=24, ignore_eos=True, **params)
    results = []
    for eager in (True, False):
        llm = LLM(model=str(tiny_checkpoint), device="cuda", dtype=dtype, max_num_seqs=16,
                  enforce_eager=eager, num_kv_blocks=512)
        assert (llm.engine.runner.decode_graphs is None) == eager
        results.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert results[0] == results[1]


class _EagerReplay:
    """Stands in for a captured graph on CPU: replay recomputes the graph's outputs in place."""

    def __init__(self, graphs, size: int):
        self.graphs, self.size = graphs, size

    def replay(self) -> None:
        logits, drawn = self.graphs.forward(self.size)
        self.graphs.logits[self.size].copy_(logits)
        self.graphs.drawn[self.size].copy_(drawn)


def replay_eagerly(graphs, rows_of) -> None:
    """Give a graph set on CPU eager replays and output buffers, as capture would."""
    for size in graphs.sizes:
        rows = rows_of(size)
        graphs.logits[size] = torch.empty(rows, graphs.model.config.vocab_size)
        graphs.drawn[size] = torch.empty(rows, dtype=torch.int64)
        graphs.graphs[size] = _EagerReplay(graphs, size)


def test_mixed_capture_sizes():
    assert mixed_capture_sizes(4096) == [16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    assert mixed_capture_sizes(100) == [16, 32, 64, 100]
    assert mixed_capture_sizes(7) == [16]


GREEDY = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)]
# plain draws, seeded and not (the graph's own draw is the answer)
PLAIN = [SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True),
         SamplingParams(temperature=1.3, seed=11, max_tokens=20, ignore_eos=True)]
# one top-k row sends every step of its batch through the torch sampler
FILTERED = PLAIN + [SamplingParams(top_k=5, max_tokens=20, ignore_eos=True)]


@pytest.mark.parametrize("params", [GREEDY, PLAIN, FILTERED], ids=["greedy", "plain", "top-k"])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_graph_input_staging_matches_eager_on_cpu(tiny_checkpoint, monkeypatch,
                                                  async_scheduling, params):
    """The graph paths' inputs (pinned staging used in turn, changed-row block tables, the
    token-source gather that fills placeholders, each row's draw temperature and seed, and
    for steps with prompt chunks the padded tokens and sequences) give the eager path's
    tokens. Graphs are replaced by eager replays, so this runs without CUDA. A 24-token
    budget splits prompts into chunks that share steps with decodes."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: t)  # no pinning on CPU
    rng = random.Random(3)
    prompts = [[rng.randrange(50256) for _ in range(rng.randint(1, 40))] for _ in range(7)]
    params = [params[i % len(params)] for i in range(len(prompts))]
    results = []
    for with_graphs in (False, True):
        llm = LLM(model=str(tiny_checkpoint), device="cpu", dtype="float32", max_num_seqs=4,
                  max_num_batched_tokens=24, num_kv_blocks=128, block_size=8,
                  attention_backend="torch", async_scheduling=async_scheduling)
        runner = llm.engine.runner
        if with_graphs:
            decode = DecodeGraphs(runner.model, runner.kv_caches, 4, runner.max_blocks_per_seq,
                                  runner.block_size, 1024, torch.device("cpu"))
            mixed = MixedGraphs(runner.model, runner.kv_caches, 24, 4,
                                runner.max_blocks_per_seq, 1024, torch.device("cpu"))
            replay_eagerly(decode, lambda size: size)
            replay_eagerly(mixed, mixed.rows)
            runner.decode_graphs, runner.mixed_graphs = decode, mixed
        results.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        if with_graphs:
            assert decode._steps_staged > 20  # decode steps went through the staging
            assert mixed._steps_staged > 5  # and so did the steps with prompt chunks
    assert results[0] == results[1]
