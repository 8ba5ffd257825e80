"""CUDA graphs: capture sizes, the stagers' buffers, graph staging == eager (CPU, with eager
replays), and graph == eager output (GPU only)."""
import random

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.core.batch import PLACEHOLDER_TOKEN, ScheduledSequence
from engine.core.config import EngineConfig
from engine.worker.cuda_graphs import (MIN_MIXED_TOKENS, DecodeGraphs, DecodeStager, GraphPlan,
                                       MaskedDrawGraphs, MixedGraphs, MixedStager, StepOutputs,
                                       capture_sizes, decode_meta_layout, mixed_capture_sizes,
                                       mixed_meta_layout)
from engine.worker.cuda_graphs.buffers import BufferLayout, token_layout
from engine.worker.inputs import prepare_host_inputs
from engine.worker.layers import masked_sample
from eager_graphs import replay_eagerly, replay_masked_draw_eagerly
from fakes import ScriptedProposer, drafts_at_rate


def test_capture_sizes_cover_every_batch():
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


def test_the_linear_table_covers_every_graphs_rows():
    """A one-stream verification runs in a small mixed graph, a draft chain's first
    iteration at two rows a sequence: their linears must be in the linear table even when
    no decode graph has that many rows."""
    config = EngineConfig.from_flat(max_num_seqs=1, max_num_batched_tokens=64)
    assert MIN_MIXED_TOKENS == 4
    assert GraphPlan.of(config).linear_row_counts() == [1, 2, 4, 8, 16, 32, 64]
    eager_mixed = EngineConfig.from_flat(max_num_seqs=4, mixed_step_graphs=False)
    assert GraphPlan.of(eager_mixed).linear_row_counts() == [1, 2, 4, 8]
    assert capture_sizes(30)[-1] == 30


@pytest.mark.gpu
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_logprobs_and_beam_search_equal_eager(tiny_checkpoint):
    """Rows asking for logprobs read them from the logprobs' graphs (LogprobGraphs), and beam
    steps copy forked blocks (BlockCopyGraph) before their graph replays: both as the eager
    engine does."""
    from engine.beam_search import BeamSearchParams

    rng = random.Random(1)
    prompts = [[rng.randrange(50256) for _ in range(rng.randint(1, 100))] for _ in range(5)]
    asked = [SamplingParams(max_tokens=12, ignore_eos=True, temperature=t, logprobs=k)
             for t, k in ((0.0, 5), (0.8, 0), (0.0, 20), (0.8, 3), (0.0, 1))]
    beam = BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True)
    results = []
    for eager in (True, False):
        llm = LLM(model=str(tiny_checkpoint), device="cuda", dtype="float16", max_num_seqs=16,
                  enforce_eager=eager, num_kv_blocks=512)
        assert (llm.engine.runner.sampler.logprob_graphs is None) == eager
        outputs = llm.generate(prompts, asked, use_tqdm=False)
        searches = llm.beam_search(prompts[:2], beam)
        runner = llm.engine.runner
        if not eager:  # forks copied their blocks in the graph; beam rows' logprobs in place
            assert runner.decode_graphs.block_copy.steps_copied > 0
            assert runner.sampler.logprob_graphs.steps_in_place > 0
        results.append(([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs],
                         [[(s.tokens, s.cum_logprob) for s in r.sequences] for r in searches]))
    (eager_outputs, eager_searches), (graph_outputs, graph_searches) = results
    for (tokens, logprobs), (graph_tokens, graph_logprobs) in zip(eager_outputs, graph_outputs):
        assert tokens == graph_tokens
        for lp, graph_lp in zip(logprobs, graph_logprobs, strict=True):
            assert graph_lp.token_logprob == pytest.approx(lp.token_logprob, abs=1e-3)
            assert graph_lp.top_logprobs == pytest.approx(lp.top_logprobs, abs=1e-3)
            # the graphs pad the batch, so their logits may differ in the last bit: ids agree
            # wherever no neighbour (nor a value past the list) comes within that
            values, k = lp.top_logprobs, len(lp.top_logprobs)
            clear = [i for i in range(k - 1)
                     if all(abs(values[i] - values[j]) > 2e-3 for j in (i - 1, i + 1) if j >= 0)]
            assert [lp.top_token_ids[i] for i in clear] == \
                [graph_lp.top_token_ids[i] for i in clear]
    for search, graph_search in zip(eager_searches, graph_searches, strict=True):
        assert [tokens for tokens, _ in search] == [tokens for tokens, _ in graph_search]
        assert [cum for _, cum in graph_search] == pytest.approx([cum for _, cum in search],
                                                                 abs=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("draft_tokens", [1, 3])
def test_draft_model_chain_graphs_equal_eager(tiny_checkpoint, draft_tokens):
    """The draft's iterations as chain graphs (one per draft length) and eagerly: the same
    tokens, and those of decoding without speculation (float32, the target drafting for
    itself: nearly every draft accepted, so drafts made ahead are taken)."""
    rng = random.Random(1)
    prompts = [[rng.randrange(50256) for _ in range(rng.randint(1, 200))] for _ in range(9)]
    params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0)
    speculative = {"model": str(tiny_checkpoint), "num_speculative_tokens": draft_tokens}
    results = []
    for eager, spec in ((True, None), (True, speculative), (False, speculative)):
        llm = LLM(model=str(tiny_checkpoint), device="cuda", dtype="float32", max_num_seqs=16,
                  enforce_eager=eager, num_kv_blocks=512, speculative_config=spec)
        if spec:
            assert (llm.engine.runner.speculation.drafter.chain.graphs == {}) == eager
            llm.engine.core.speculator.switch = None  # every step drafts, whatever it costs
        results.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        if spec:
            stats = llm.engine.core.speculator.stats
            assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens > 0
            # the chain drafted ahead once the batch was all verification
            assert llm.engine.runner.speculation.drafter.num_taken_ahead > 0
    assert results[0] == results[1] == results[2]


def test_mixed_capture_sizes():
    assert mixed_capture_sizes(4096) == [4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    assert mixed_capture_sizes(100) == [4, 8, 16, 32, 64, 100]
    assert mixed_capture_sizes(7) == [4, 7]
    assert mixed_capture_sizes(3) == [4]


GREEDY = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)]
# plain draws, seeded and not (the graph's own draw is the answer)
PLAIN = [SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True),
         SamplingParams(temperature=1.3, seed=11, max_tokens=20, ignore_eos=True)]
# one top-k row sends every step of its batch through the torch sampler
FILTERED = PLAIN + [SamplingParams(top_k=5, max_tokens=20, ignore_eos=True)]
# a structured-output row (a regex that never completes): drawn again under its grammar mask,
# which changes from token to token (a stale mask would draw other tokens)
STRUCTURED = PLAIN + [SamplingParams(temperature=0.9, max_tokens=20, ignore_eos=True,
                                     structured_outputs=StructuredOutputsParams(
                                         regex="([a-m][n-z ]){100}"))]


def eager_step_graphs(runner, max_seqs: int, max_tokens: int, copy_blocks: bool = False,
                      masked_rows: int = 0) -> tuple[StepOutputs, DecodeGraphs, MixedGraphs]:
    """A CPU runner's decode and mixed-step graphs with eager replays, writing one
    StepOutputs, installed as capture_graphs installs them (fp32, max_model_len 1024); with
    `copy_blocks`, the decode graphs make their steps' block copies; with `masked_rows`, they
    hold a segment for their masked draws' inputs."""
    from engine.worker.layers import copy_staged_blocks

    cpu, model = torch.device("cpu"), runner.model
    step = StepOutputs(max_seqs, model.config.padded_vocab_size, model.config.vocab_size,
                       torch.float32, cpu)
    decode = DecodeGraphs(model, runner.kv_caches, capture_sizes(max_seqs),
                          runner.max_blocks_per_seq, runner.block_size, 1024, cpu,
                          step_outputs=step,
                          copy_staged_blocks=copy_staged_blocks if copy_blocks else None,
                          max_copies=max_seqs, masked_rows=masked_rows)
    mixed = MixedGraphs(model, runner.kv_caches, mixed_capture_sizes(max_tokens), max_seqs,
                        runner.max_blocks_per_seq, 1024, cpu, step_outputs=step)
    replay_eagerly(decode)
    replay_eagerly(mixed)
    runner.decode_graphs, runner.mixed_graphs = decode, mixed
    return step, decode, mixed


@pytest.mark.slow
@pytest.mark.parametrize("params", [GREEDY, PLAIN, FILTERED, STRUCTURED],
                         ids=["greedy", "plain", "top-k", "structured"])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_graph_input_staging_matches_eager_on_cpu(tiny_checkpoint, monkeypatch,
                                                  async_scheduling, params):
    """The graph paths' inputs (pinned staging used in turn, changed-row block tables, the
    token-source gather that fills placeholders from the StepOutputs' draws, decode steps
    continuing the last one by row index (ModelRunner._launch_plain_decode), steps sent as
    DecodeContinuations (staged from the last step's arrays, constrained rows drawn again by
    their request ids, or expanded where a top-k row takes the general path), each row's draw
    temperature and seed, and for steps with prompt chunks the padded tokens and sequences)
    give the eager path's
    tokens, and so do structured-output rows drawn again in the graphs' StepOutputs
    (MaskedDrawGraphs), in continued steps too, whose draws read their inputs staged with the
    step's. Graphs are replaced by eager replays, so this runs without CUDA. A 24-token budget splits prompts into chunks that share steps with
    decodes."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: t)  # no pinning on CPU
    rng = random.Random(3)
    prompts = [[rng.randrange(50256) for _ in range(rng.randint(1, 40))] for _ in range(7)]
    filtered, structured = params is FILTERED, params is STRUCTURED
    params = [params[i % len(params)] for i in range(len(prompts))]
    results, masked_draws = [], []
    for with_graphs in (False, True):
        llm = LLM(model=str(tiny_checkpoint), device="cpu", dtype="float32", max_num_seqs=4,
                  max_num_batched_tokens=24, num_kv_blocks=128, block_size=8,
                  attention_backend="torch", async_scheduling=async_scheduling)
        runner = llm.engine.runner
        if with_graphs:
            step, decode, mixed = eager_step_graphs(runner, max_seqs=4, max_tokens=24,
                                                    masked_rows=MaskedDrawGraphs.rows_for(4))
            masked = runner.sampler.masked_graphs = MaskedDrawGraphs(
                lambda *args: masked_draws.append(args[1].shape[0]) or masked_sample(*args),
                step, -(-runner.model.config.vocab_size // 32), 4, torch.device("cpu"),
                decode.masked_draw_inputs)
            replay_masked_draw_eagerly(masked, staged=True)
            continuations, launch = [], runner.launch
            monkeypatch.setattr(runner, "launch", lambda out: continuations.append(
                out.continued is not None) or launch(out))
        results.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        if with_graphs:
            assert decode.steps_staged > 20  # decode steps went through the staging
            assert mixed.steps_staged > 5  # and so did the steps with prompt chunks
            # steps of placeholder rows after a plain decode step continue it by index (with
            # a top-k row, only once it has finished); no placeholders without async
            if not async_scheduling:
                assert decode.steps_continued == 0
            elif not filtered:  # structured-output rows continue too, drawn again
                assert decode.steps_continued > 10
            # every step with a constrained row drew it again in the graphs' outputs, those
            # continuing a decode step from inputs staged with it
            assert (len(masked_draws) > 20) == structured
            assert (masked.steps_staged > 10) == (structured and async_scheduling)
            # steady steps are sent as continuations, constrained rows among them
            assert (sum(continuations) > 5) == async_scheduling
    assert results[0] == results[1]


@pytest.mark.slow
def test_beam_search_through_the_graph_paths_matches_eager_on_cpu(tiny_checkpoint, monkeypatch):
    """Beam steps through eager stand-ins of the step graphs, of the logprobs' graphs (which
    read the beams' rows in the StepOutputs in place) and of the block-copy graphs (the forks'
    copies: staged with a decode step's inputs, or on their own in other steps) give the
    eager engine's searches."""
    from engine.beam_search import BeamSearchParams
    from engine.worker.block_copy import kv_storage
    from engine.worker.cuda_graphs import BlockCopyGraph, LogprobGraphs
    from engine.worker.layers import copy_staged_blocks, token_logprobs
    from eager_graphs import replay_block_copy_eagerly, replay_logprobs_eagerly

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: t)  # no pinning on CPU
    rng = random.Random(5)
    # the long prompt's chunks share steps with the others' forks: those steps are not decode
    # steps, and copy through the runner's own block-copy graph (2 beams each: the three
    # searches fit the 8 sequences at once)
    prompts = [[rng.randrange(50256) for _ in range(n)] for n in (rng.randint(3, 30),
                                                                  rng.randint(3, 30), 150)]
    beam = BeamSearchParams(beam_width=2, max_tokens=12, ignore_eos=True)
    results = []
    for with_graphs in (False, True):
        llm = LLM(model=str(tiny_checkpoint), device="cpu", dtype="float32", max_num_seqs=8,
                  max_num_batched_tokens=64, num_kv_blocks=128, block_size=4,
                  attention_backend="torch")
        runner = llm.engine.runner
        if with_graphs:
            step, decode, _ = eager_step_graphs(runner, max_seqs=8, max_tokens=64,
                                                copy_blocks=True)
            logprobs = LogprobGraphs(token_logprobs, step, torch.float32, 8, torch.device("cpu"))
            replay_logprobs_eagerly(logprobs)
            runner.sampler.logprob_graphs = logprobs
            runner.block_copy_graph = BlockCopyGraph(copy_staged_blocks,
                                                     kv_storage(runner.kv_caches), 8)
            replay_block_copy_eagerly(runner.block_copy_graph)
        searches = llm.beam_search(prompts, beam)
        results.append([[(s.tokens, s.cum_logprob) for s in r.sequences] for r in searches])
        if with_graphs:  # forks copied partial blocks, in decode steps with their inputs
            assert decode.block_copy.steps_copied > 5
            assert runner.block_copy_graph.steps_copied > 0  # and in the long prompt's steps
            assert logprobs.steps_in_place > 10  # beam rows' logprobs read in place
    for search, graph_search in zip(*results, strict=True):
        assert [tokens for tokens, _ in search] == [tokens for tokens, _ in graph_search]
        assert [cum for _, cum in graph_search] == pytest.approx([cum for _, cum in search],
                                                                 abs=1e-4)


def filled_views(layout: BufferLayout, dtype: type):
    """Named views of a buffer filled with 99, so rows the stager leaves alone stand out."""
    return layout.views(np.full(layout.size, 99, dtype))


def test_buffer_layout_views_numpy_and_torch_alike():
    layout = BufferLayout(a=2, table=(2, 3), bits=2, bits_of={"bits": "float64"})
    host, device = np.arange(layout.size, dtype=np.int64), torch.arange(layout.size)
    for views in (layout.views(host), layout.views(device)):
        assert views.a.tolist() == [0, 1] and views.table.tolist() == [[2, 3, 4], [5, 6, 7]]
    layout.views(host).bits[:] = [0.5, -2.0]
    assert layout.views(torch.from_numpy(host)).bits.tolist() == [0.5, -2.0]
    assert (layout.start("table"), layout.end("table", 1), layout.size) == (2, 5, 10)


def test_decode_stager_matches_host_inputs_as_the_batch_changes():
    """The graphs' staging writes what prepare_host_inputs computes, row for row, while rows
    shift, sequences gain blocks, one is replaced by another with as many blocks, and the
    padded size shrinks and grows; padding rows are (0, 0, -1), seq_len 1, block 0, and
    draw greedily (temperature 0, seed 0)."""
    n, width, bs = 4, 8, 16
    tokens = filled_views(token_layout(n), np.int64)
    meta = filled_views(decode_meta_layout(n, width), np.int32)
    stager = DecodeStager(tokens, meta, bs)
    params = SamplingParams()

    def seq(name, pos, blocks):
        return ScheduledSequence(name, [pos % 50], pos, blocks, True, params)

    steps = [[seq("a", 15, [4]), seq("b", 40, [1, 2, 3])],
             [seq("a", 16, [4, 7]), seq("b", 41, [1, 2, 3]), seq("c", 3, [9])],
             [seq("b", 42, [1, 2, 3]), seq("c", 4, [9])],  # a finished: rows shift up
             [seq("d", 42, [5, 6, 8]), seq("c", 5, [9])]]  # d: new blocks, same count as b
    for step, seqs in enumerate(steps):
        size = 4 if len(seqs) > 2 else 2
        b = len(seqs)
        temperature, seeds = np.linspace(0.5, 1.5, b), np.arange(b) + 1000 * step
        stager.write(seqs, size, [-1] * b, (temperature, seeds))
        host = prepare_host_inputs(seqs, bs, width)
        assert tokens.draw_seeds[:size].tolist() == seeds.tolist() + [0] * (size - b)
        assert tokens.draw_temperature[:size].tolist() == temperature.tolist() + [0.0] * (
            size - b)
        for name in ("token_ids", "positions", "slot_mapping"):
            assert getattr(tokens, name)[:b].tolist() == getattr(host, name).tolist(), name
        assert tokens.token_source[:size].tolist() == list(range(n, n + size))  # own tokens
        assert tokens.token_ids[b:size].tolist() == tokens.positions[b:size].tolist() == [
            0] * (size - b)
        assert tokens.slot_mapping[b:size].tolist() == [-1] * (size - b)
        assert meta.seq_lens[:b].tolist() == host.seq_lens.tolist()
        assert meta.seq_lens[b:size].tolist() == [1] * (size - b)
        for row, s in enumerate(seqs):
            assert meta.block_tables[row, :len(s.block_ids)].tolist() == s.block_ids
        assert (meta.block_tables[b:size, 0] == 0).all()
    placeholder = ScheduledSequence("c", [PLACEHOLDER_TOKEN], 6, [9], True, params, (), (),
                                    0, 3)
    stager.write([seq("d", 43, [5, 6, 8]), placeholder], 2, [-1, 3],
                 (np.ones(2), np.zeros(2, np.int64)))
    assert tokens.token_source[:2].tolist() == [n, 3]  # c's token: row 3 of prev_tokens


def test_mixed_stager_pads_tokens_and_sequences():
    """A step with a prompt chunk and decodes (one a placeholder) staged for the mixed-step
    graph of 16 tokens and 6 sequence rows: real rows as prepare_host_inputs computes them;
    padding tokens (0, 0, slot -1, own token), padding sequences with no new tokens (query
    start at the real end, seq_len 0), padding sample rows greedy."""
    n, max_seqs, width, bs = 32, 6, 8, 16
    tokens = filled_views(token_layout(n), np.int64)
    meta = filled_views(mixed_meta_layout(max_seqs, width), np.int32)
    stager = MixedStager(tokens, meta)
    params = SamplingParams()
    seqs = [ScheduledSequence("a", [5, 6, 7, 8, 9], 0, (3,), True, params),
            ScheduledSequence("b", [PLACEHOLDER_TOKEN], 20, (1, 2), True, params, (), (), 0, 4),
            ScheduledSequence("c", [11, 12], 4, (4,), False, params),
            ScheduledSequence("d", [13], 30, (6, 7), True, params)]
    host = prepare_host_inputs(seqs, bs, width)
    temperature, seeds = np.array([0.5, 1.0, 0.0]), np.array([7, 8, 9])
    stager.write(host, [-1, 4, -1, -1], (temperature, seeds), 16, 6)
    t, s = len(host.token_ids), len(seqs)
    assert tokens.token_ids[:t].tolist() == [5, 6, 7, 8, 9, 0, 11, 12, 13]
    assert tokens.positions[:t].tolist() == host.positions.tolist()
    assert tokens.slot_mapping[:t].tolist() == host.slot_mapping.tolist()
    assert tokens.token_ids[t:16].tolist() == tokens.positions[t:16].tolist() == [0] * (16 - t)
    assert tokens.slot_mapping[t:16].tolist() == [-1] * (16 - t)
    expected_source = list(range(n, n + 16))
    expected_source[5] = 4  # b's token: row 4 of the previous step's samples
    assert tokens.token_source[:16].tolist() == expected_source
    assert tokens.draw_seeds[:6].tolist() == [7, 8, 9, 0, 0, 0]
    assert tokens.draw_temperature[:6].tolist() == [0.5, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert meta.query_start_loc[:7].tolist() == host.query_start_loc.tolist() + [t] * 2
    assert meta.seq_lens[:6].tolist() == host.seq_lens.tolist() + [0, 0]
    assert meta.sample_rows[:6].tolist() == host.sample_indices.tolist() + [0] * 3
    assert meta.block_tables[:s].tolist() == host.block_tables.tolist()


def test_mixed_stager_writes_a_row_per_draft_position():
    """A sequence with d drafts samples its last d + 1 token rows; the graph holds more
    sampling rows than sequence rows (max_num_seqs (k + 1)), padded greedy."""
    n, max_seqs, width, bs = 32, 3, 8, 16
    tokens = filled_views(token_layout(n), np.int64)
    meta = filled_views(mixed_meta_layout(max_seqs, width, max_seqs * 3), np.int32)
    params = SamplingParams()
    seqs = [ScheduledSequence("a", [5, 6, 7], 10, (3,), True, params, num_drafts=2),
            ScheduledSequence("b", [8], 3, (1,), True, params),
            ScheduledSequence("c", [1, 2], 0, (2,), False, params)]
    host = prepare_host_inputs(seqs, bs, width)
    assert host.sample_indices.tolist() == [0, 1, 2, 3]
    seeds = np.array([7, 8, 9, 10])
    MixedStager(tokens, meta).write(host, [-1] * 3, (np.full(4, 0.5), seeds), 16, 3, 9)
    assert meta.sample_rows.tolist() == [0, 1, 2, 3] + [0] * 5
    assert tokens.draw_seeds[:9].tolist() == [7, 8, 9, 10] + [0] * 5
    assert tokens.draw_temperature[:9].tolist() == [0.5] * 4 + [0.0] * 5


# seeded rows: their tokens do not depend on how many rows a step draws
SEEDED = [SamplingParams(temperature=1.3, seed=11, max_tokens=8, ignore_eos=True),
          SamplingParams(temperature=0.9, top_k=5, seed=4, max_tokens=8, ignore_eos=True)]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_speculative_steps_through_the_mixed_graph_staging_match_plain_on_cpu(
        tiny_checkpoint, monkeypatch, params, method):
    """Verification steps (k + 1 tokens a decoding row, a sampling row per draft position)
    replay the mixed-step graph of their padded token count, replaced by eager replays as
    above: the tokens are those of plain eager decoding. For the n-gram method a scripted
    proposer drafts them, each draft corrupted with probability 0.3; the draft model (the
    target's own weights, its iterations through its chain's staging) writes its drafts
    into the staged token ids on the device."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: t)
    rng = random.Random(5)
    prompts = [[rng.randrange(50256) for _ in range(rng.randint(1, 30))] for _ in range(4)]
    params = [params[i % len(params)] for i in range(len(prompts))]
    results = []
    speculative = {"num_speculative_tokens": 3, "prompt_lookup_max": 2}
    if method == "draft_model":
        speculative = {"num_speculative_tokens": 3, "model": str(tiny_checkpoint)}
    for speculative in (None, speculative):
        llm = LLM(model=str(tiny_checkpoint), device="cpu", dtype="float32", max_num_seqs=4,
                  max_num_batched_tokens=24, num_kv_blocks=128, block_size=8,
                  attention_backend="torch", speculative_config=speculative)
        runner = llm.engine.runner
        if speculative:
            follower = runner.speculation.follower
            mixed = MixedGraphs(runner.model, runner.kv_caches, mixed_capture_sizes(24), 4,
                                runner.max_blocks_per_seq, 1024, torch.device("cpu"),
                                runner.graph_plan.max_sample_rows, follower)
            replay_eagerly(mixed)
            runner.mixed_graphs = mixed
        if speculative and method == "draft_model":
            chain = runner.speculation.drafter.chain
        if speculative and method == "ngram":
            proposer = llm.engine.core.speculator.proposer = ScriptedProposer()
            for i, reference in enumerate(results[0]):  # the LLM's own request ids
                proposer.add(f"{i}#0", drafts_at_rate(reference, 0.7, i, 50257))
        results.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert results[0] == results[1]
    assert llm.engine.core.speculator.stats.num_accepted_tokens > 0
    assert mixed.steps_staged >= 5  # the verification steps went through the staging
    if method == "draft_model":  # and the draft's iterations through its chain graphs'
        assert chain.steps_staged >= 5
