"""Prompt logprobs (vLLM's SamplingParams.prompt_logprobs) on CPU: every position's logprob,
rank and top-k against transformers' log_softmax of the same checkpoint, through chunked
prefill, the prefix cache, preemption and max_tokens 0; slices bound the float32 logits; a
step without prompt logprobs computes none. A fake runner checks the scheduler's side: each
position is reported once, whatever preemptions recompute. The output processor's maps and
decoded tokens are vLLM's; steps with prompt logprobs replay the mixed-step graphs (their
staging on CPU with eager replays; the captured graphs against eager on CUDA)."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.batch import (PromptLogprobs, PromptLogprobsJob, ScheduledSequence,
                               SchedulerOutput)
from engine.core.config import EngineConfig
from engine.llm import LLMEngine
from engine.output.outputs import FlatPromptLogprobs, Logprob
from engine.output.tokenizer import Tokenizer
from engine.worker.cuda_graphs import MixedGraphs, mixed_capture_sizes
from engine.worker.layers import prompt_logprobs
from engine.worker.prompt_logprobs import SLICE_ROWS, compute_prompt_logprobs
from eager_graphs import replay_eagerly
from fakes import CompletedStep, PipelinedFakeRunner

TOLERANCE = 1e-4  # float32 on CPU: the paged forward against transformers' dense one
PROMPT_LENGTHS = [1, 2, 17, 64, 150]


def random_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50256) for _ in range(n)]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [random_prompt(n, seed) for seed, n in enumerate(PROMPT_LENGTHS)]


@pytest.fixture(scope="module")
def hf_logprobs(tiny_checkpoint, prompts) -> list[torch.Tensor]:
    """transformers' log_softmax at every position of each prompt: [len(prompt), vocab]."""
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(tiny_checkpoint, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([p])).logits[0].float(), dim=-1)
                for p in prompts]


def make_llm(checkpoint, **overrides) -> LLM:
    settings = dict(device="cpu", dtype="float32", num_kv_blocks=256, attention_backend="torch")
    return LLM(model=str(checkpoint), **{**settings, **overrides})


def check_against_hf(prompt: list[int], entries, hf: torch.Tensor, k: int) -> None:
    """vLLM's shape (None, then one map per later token) and transformers' values: the token's
    logprob and rank (bracketed: values within TOLERANCE of the token's may order either way),
    and the k likeliest tokens, ranked 1..k, each at its own logprob."""
    assert len(entries) == len(prompt) and entries[0] is None
    for index in range(1, len(prompt)):
        row, token, entry = hf[index - 1], prompt[index], entries[index]
        own = entry[token]
        assert abs(own.logprob - row[token].item()) < TOLERANCE
        surely_above = int((row > row[token] + TOLERANCE).sum())
        maybe_above = int((row >= row[token] - TOLERANCE).sum())
        assert surely_above + 1 <= own.rank <= maybe_above
        top = sorted((lp.rank, t) for t, lp in entry.items() if lp.rank <= k)
        assert [rank for rank, _ in top] == list(range(1, k + 1))
        assert len(entry) == k + (own.rank > k)
        hf_top = row.topk(k).values if k else []
        for rank, t in top:
            assert abs(entry[t].logprob - row[t].item()) < TOLERANCE
            assert abs(entry[t].logprob - hf_top[rank - 1].item()) < TOLERANCE
        assert all(lp.decoded_token for lp in entry.values())


@pytest.mark.parametrize("overrides", [
    {}, {"max_num_batched_tokens": 16}, {"max_num_batched_tokens": 16, "async_scheduling": False},
    {"num_kv_blocks": 40, "block_size": 4, "max_num_batched_tokens": 32},
], ids=["one-chunk", "chunked-prefill", "chunked-sync", "preemption"])
def test_prompt_logprobs_match_transformers_at_every_position(tiny_checkpoint, prompts,
                                                              hf_logprobs, overrides):
    llm = make_llm(tiny_checkpoint, **overrides)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, output, hf in zip(prompts, outputs, hf_logprobs):
        check_against_hf(prompt, output.prompt_logprobs, hf, k=3)
        assert len(output.token_ids) == 4
    if "num_kv_blocks" in overrides:
        assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_zero_top_logprobs_is_the_prompt_token_alone(tiny_checkpoint, prompts, hf_logprobs):
    llm = make_llm(tiny_checkpoint, max_num_batched_tokens=16)
    [output] = llm.generate([prompts[3]], SamplingParams(max_tokens=1, prompt_logprobs=0),
                            use_tqdm=False)
    for index, entry in enumerate(output.prompt_logprobs[1:], start=1):
        token = prompts[3][index]
        assert list(entry) == [token]
        assert abs(entry[token].logprob - hf_logprobs[3][index - 1, token].item()) < TOLERANCE


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(tiny_checkpoint, prompts,
                                                                 hf_logprobs):
    llm = make_llm(tiny_checkpoint, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=2)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, output, hf in zip(prompts, outputs, hf_logprobs):
        assert output.token_ids == [] and output.text == "" and output.finish_reason == "length"
        check_against_hf(prompt, output.prompt_logprobs, hf, k=2)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_a_cached_prompt_is_recomputed_for_its_logprobs_and_still_shared(tiny_checkpoint,
                                                                         prompts, hf_logprobs):
    """The prefix cache holds the prompt's blocks; a request asking for prompt logprobs takes
    none of them (every position's logits are needed), publishes its own, and a later plain
    request hits them."""
    llm = make_llm(tiny_checkpoint)
    engine, prompt = llm.engine, prompts[4]
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate([prompt], plain, use_tqdm=False)
    hits = engine.block_manager.prefix_hits
    [scored] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2,
                                                     prompt_logprobs=1), use_tqdm=False)
    assert engine.block_manager.prefix_hits == hits and scored.metrics[0].num_cached_tokens == 0
    check_against_hf(prompt, scored.prompt_logprobs, hf_logprobs[4], k=1)
    [again] = llm.generate([prompt], plain, use_tqdm=False)
    assert again.metrics[0].num_cached_tokens > 0


def test_n_choices_share_the_prompt_logprobs_of_one(tiny_checkpoint, prompts, hf_logprobs):
    llm = make_llm(tiny_checkpoint)
    [output] = llm.generate([prompts[2]], SamplingParams(n=3, max_tokens=3, seed=1,
                                                         prompt_logprobs=2), use_tqdm=False)
    assert len(output.outputs) == 3
    check_against_hf(prompts[2], output.prompt_logprobs, hf_logprobs[2], k=2)


def test_slices_bound_the_logits(tiny_checkpoint):
    """A 1000-position job reaches lm_head in slices of at most SLICE_ROWS rows, and gives
    what one whole pass would."""
    torch.manual_seed(0)
    vocab, width = 300, 8
    weight = torch.randn(vocab, width)
    hidden = torch.randn(1015, width)  # rows 9.. are the sequence's 1006 tokens
    calls: list[int] = []

    def lm_head(rows: torch.Tensor) -> torch.Tensor:
        calls.append(rows.shape[0])
        return rows @ weight.T

    targets = torch.randint(0, vocab, (1000,))
    seq = ScheduledSequence("a", [0] * 1006, 0, (0,), True, SamplingParams(),
                            prompt_logprobs=PromptLogprobsJob(5, tuple(targets.tolist()), 4))
    out = compute_prompt_logprobs(hidden, lm_head, prompt_logprobs, [seq],
                                  np.array([9, 1015]))
    assert max(calls) <= SLICE_ROWS and sum(calls) == 1000
    whole = torch.log_softmax(hidden[14:1014] @ weight.T, dim=-1)
    [result] = out.to_host().values()
    assert result.first_index == 6
    expected = whole.gather(1, targets[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(result.token_logprobs), expected, atol=1e-5)
    assert result.ranks == (whole >= expected[:, None]).sum(-1).tolist()
    assert torch.allclose(torch.tensor(result.top_logprobs), whole.topk(4).values, atol=1e-5)


def test_jobs_apart_in_a_step_gather_their_own_rows():
    """Two jobs whose rows do not make one run (a sequence without a job between them, and
    one starting past its chunk's first row) read their own rows, as one job each would."""
    torch.manual_seed(1)
    vocab, width = 50, 8
    weight = torch.randn(vocab, width)
    hidden = torch.randn(30, width)

    def lm_head(rows: torch.Tensor) -> torch.Tensor:
        return rows @ weight.T

    def seq(name: str, n: int, job: PromptLogprobsJob | None) -> ScheduledSequence:
        return ScheduledSequence(name, [0] * n, 0, (0,), True, SamplingParams(),
                                 prompt_logprobs=job)

    jobs = {"a": PromptLogprobsJob(0, (3, 4, 5, 6, 7), 2),
            "c": PromptLogprobsJob(2, tuple(range(10, 20)), 3)}
    seqs = [seq("a", 6, jobs["a"]), seq("b", 4, None), seq("c", 20, jobs["c"])]
    together = compute_prompt_logprobs(hidden, lm_head, prompt_logprobs, seqs,
                                       np.array([0, 6, 10, 30]))
    together = together.to_host()
    alone = {**compute_prompt_logprobs(hidden[:6], lm_head, prompt_logprobs, seqs[:1],
                                       np.array([0, 6])).to_host(),
             **compute_prompt_logprobs(hidden[10:], lm_head, prompt_logprobs, seqs[2:],
                                       np.array([0, 20])).to_host()}
    for name, result in together.items():  # the same rows: equal up to the matmul's rounding
        assert (result.first_index, result.ranks, result.top_token_ids) == (
            alone[name].first_index, alone[name].ranks, alone[name].top_token_ids)
        assert np.allclose(result.token_logprobs, alone[name].token_logprobs, atol=1e-5)
        assert np.allclose(result.top_logprobs, alone[name].top_logprobs, atol=1e-5)
    whole = torch.log_softmax(hidden[12:22] @ weight.T, dim=-1)
    assert torch.allclose(torch.tensor(together["c"].token_logprobs),
                          whole.gather(1, torch.arange(10, 20)[:, None]).squeeze(1), atol=1e-5)
    assert [len(ids) for ids in together["a"].top_token_ids] == [2] * 5


def test_a_single_tokens_text_is_its_decoding_alone():
    """The per-token table behind decode([t]) and the prompt logprobs' decoded tokens holds
    tiktoken's decoding of each token alone, partial UTF-8 characters as U+FFFD."""
    tokenizer = Tokenizer()
    table = tokenizer.token_string_table
    assert len(table) == tokenizer.vocab_size
    assert table == [tokenizer.encoding.decode([t], errors="replace") for t in range(len(table))]
    assert all(tokenizer.decode([t]) == table[t] for t in (0, 198, 50256, 447, 8582))
    assert "\ufffd" in table[447] and tokenizer.decode([447, 247]) == "\u2019"


def test_prompt_logprobs_maps_hold_the_token_then_the_top_k():
    """vLLM's map at each position: the prompt token's own Logprob first, then the top-k by
    rank; a token among the top-k keeps its place in the map with its top-k Logprob."""
    tokenizer = Tokenizer()
    built = FlatPromptLogprobs([5, 10, 20, 30], tokenizer.token_string_table)
    built.add(PromptLogprobs(1, [-1.5, -0.5], [7, 1], [[40, 41], [20, 42]],
                             [[-0.1, -0.2], [-0.5, -1.0]]))
    assert not built.complete  # position 3 has not arrived
    built.add(PromptLogprobs(3, [-3.0], [2], [[0, 30]], [[-0.25, -3.0]]))
    text = tokenizer.encoding.decode
    expected = [None,
                {10: Logprob(-1.5, 7, text([10])), 40: Logprob(-0.1, 1, text([40])),
                 41: Logprob(-0.2, 2, text([41]))},
                {20: Logprob(-0.5, 1, text([20])), 42: Logprob(-1.0, 2, text([42]))},
                {30: Logprob(-3.0, 2, text([30])), 0: Logprob(-0.25, 1, text([0]))}]
    assert built.complete
    entries = list(built)
    assert entries == expected and built == expected
    assert [list(e) for e in entries[1:]] == [list(e) for e in expected[1:]]  # key order
    assert all(type(lp) is Logprob for e in entries[1:] for lp in e.values())


@pytest.mark.slow
def test_prompt_logprob_steps_replay_the_mixed_graph_staging_on_cpu(tiny_checkpoint, prompts,
                                                                    hf_logprobs, monkeypatch):
    """Steps with prompt logprobs (chunks of several prompts, beside decodes) go through the
    mixed-step graphs, replaced by eager replays on CPU: their prompt logprobs, read from the
    graph's hidden-state output after the replay, are transformers' at every position."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: t)  # no pinning on CPU
    llm = make_llm(tiny_checkpoint, max_num_seqs=4, max_num_batched_tokens=64)
    runner = llm.engine.runner
    mixed = MixedGraphs(runner.model, runner.kv_caches, mixed_capture_sizes(64), 4,
                        runner.max_blocks_per_seq, 1024, torch.device("cpu"))
    replay_eagerly(mixed)
    runner.mixed_graphs = mixed
    read = []
    hidden = mixed.hidden
    monkeypatch.setattr(mixed, "hidden", lambda n: read.append(n) or hidden(n))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, output, hf in zip(prompts, outputs, hf_logprobs):
        check_against_hf(prompt, output.prompt_logprobs, hf, k=3)
    assert len(read) >= 4 and max(read) > 32  # several steps, some in the largest graph


CUDA_GRAPH_DTYPES = {"float32": TOLERANCE, "float16": 5e-2}  # graph against eager


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", list(CUDA_GRAPH_DTYPES))
def test_prompt_logprobs_from_the_mixed_graph_equal_eager_on_cuda(tiny_checkpoint, prompts,
                                                                  hf_logprobs, dtype):
    """Steps with prompt logprobs replay the captured mixed-step graphs (chunked prefill:
    several sizes, beside decodes) and read the graph's static hidden-state output: the
    prompt logprobs are the eager run's (in float32 also transformers', at every position),
    and the tokens too."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)

    def generate(eager: bool) -> list:
        llm = make_llm(tiny_checkpoint, device="cuda", dtype=dtype, attention_backend="auto",
                       max_num_seqs=4, max_num_batched_tokens=64, enforce_eager=eager)
        graphs = llm.engine.runner.mixed_graphs
        assert (graphs is None) == eager
        if eager:
            return llm.generate(prompts, params, use_tqdm=False)
        read, hidden = [], graphs.hidden
        graphs.hidden = lambda n: read.append(n) or hidden(n)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert len(read) >= 4 and max(read) > 32  # graphs of several sizes served them
        return outputs

    runs = {eager: generate(eager) for eager in (True, False)}
    if dtype == "float32":
        for outputs in runs.values():
            for prompt, output, hf in zip(prompts, outputs, hf_logprobs):
                check_against_hf(prompt, output.prompt_logprobs, hf, k=3)
    tolerance = CUDA_GRAPH_DTYPES[dtype]
    for prompt, eager, graph in zip(prompts, runs[True], runs[False]):
        assert len(graph.prompt_logprobs) == len(prompt) and graph.prompt_logprobs[0] is None
        for index in range(1, len(prompt)):
            token = prompt[index]
            assert abs(graph.prompt_logprobs[index][token].logprob
                       - eager.prompt_logprobs[index][token].logprob) < tolerance
        if dtype == "float32":
            assert graph.token_ids == eager.token_ids


def test_a_step_without_prompt_logprobs_computes_none(tiny_checkpoint, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("prompt logprobs computed for a step that asked for none")

    monkeypatch.setattr("engine.worker.model_runner.compute_prompt_logprobs", refuse)
    llm = make_llm(tiny_checkpoint, max_num_batched_tokens=16)
    scheduled: list[SchedulerOutput] = []
    launch = llm.engine.runner.launch
    llm.engine.core.runner.launch = lambda out: scheduled.append(out) or launch(out)
    [output] = llm.generate([random_prompt(40, 9)], SamplingParams(max_tokens=3),
                            use_tqdm=False)
    assert output.prompt_logprobs is None and len(output.token_ids) == 3
    assert len(scheduled) > 3 and not any(out.has_prompt_logprobs for out in scheduled)
    assert all(s.prompt_logprobs is None for out in scheduled for s in out.sequences)


class PromptLogprobsFakeRunner(PipelinedFakeRunner):
    """PipelinedFakeRunner that answers each PromptLogprobsJob with logprob -index at prompt
    index `index` (rank index), so a position reported twice, or not at all, shows."""

    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size)
        self.skipped_reported = 0  # jobs that started past their chunk's first row

    def launch(self, out: SchedulerOutput) -> CompletedStep:
        result = super().launch(out).result
        for seq in out.sequences:
            job = seq.prompt_logprobs
            if job is None:
                continue
            self.skipped_reported += job.first_row > 0
            first = seq.start_position + job.first_row + 1
            indices = range(first, first + len(job.target_ids))
            result.prompt_logprobs[seq.request_id] = PromptLogprobs(
                first, [-float(i) for i in indices], list(indices), [[] for _ in indices],
                [[] for _ in indices])
        return CompletedStep(result)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_preempted_prompts_report_each_position_once(async_scheduling):
    """A small pool preempts requests in the middle of their prompts; recomputed, they report
    only the positions not reported yet, and every request gets every position."""
    num_blocks = 12
    config = EngineConfig.from_flat(block_size=4, num_kv_blocks=num_blocks, max_num_seqs=4,
                                    max_num_batched_tokens=12, async_scheduling=async_scheduling)
    runner = PromptLogprobsFakeRunner(num_blocks, 4)
    engine = LLMEngine(config, runner=runner)
    rng = random.Random(3)
    prompts = {f"r{i}": [rng.randrange(90) for _ in range(rng.randint(20, 36))]
               for i in range(6)}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=rng.choice([0, 3]),
                                                       ignore_eos=True, prompt_logprobs=0,
                                                       output_kind="final_only"))
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({out.request_id: out for out in engine.step() if out.finished})
        engine.block_manager.check_invariants()
    assert engine.scheduler.num_preemptions > 0 and runner.skipped_reported > 0
    for rid, prompt in prompts.items():
        entries = finals[rid].prompt_logprobs
        assert entries is not None and entries[0] is None
        assert [e[prompt[i]].logprob for i, e in enumerate(entries) if i] == \
            [-float(i) for i in range(1, len(prompt))]
    assert engine.block_manager.num_free_blocks == num_blocks
