"""Beam search inside the engine core, over the prefix-dependent fake runner (fakes.py, no
torch) given logprobs: a search's results equal a reference search that recomputes every beam
from its whole token list, whatever the pool, token budget, block size, prefix caching and
scheduling ahead. Forks share their parents' blocks and copy the partial last one: a missing
or wrong copy changes the fake KV, so the logprobs. Beams are never preempted, a step of a
search is one decode token per live beam, and ordinary requests beside searches keep their
reference outputs."""
from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.beam_search import BeamSearchParams, beam_sequences
from engine.core.batch import RunnerOutput, SchedulerOutput, TokenLogprobs
from engine.core.beam import BeamSearch, reserved_blocks
from engine.core.config import EngineConfig
from engine.core.request import EOS_TOKEN_ID, SamplingParams
from engine.llm import LLMEngine
from fakes import PipelinedFakeRunner, kv_entry, reference_output

TOKENS = list(range(12)) + [EOS_TOKEN_ID]  # the fake model's vocabulary, for logprobs


def fake_logprobs(entry: int, k: int) -> TokenLogprobs:
    """The top k of a distribution over TOKENS drawn from the KV entry of the last position."""
    rng = random.Random(entry)
    logits = [rng.gauss(0.0, 2.0) for _ in TOKENS]
    norm = math.log(sum(math.exp(x) for x in logits))
    top = sorted(zip(logits, TOKENS), reverse=True)[:k]
    return TokenLogprobs(top[0][0] - norm, [t for _, t in top], [x - norm for x, _ in top])


def prefix_entry(tokens: list[int]) -> int:
    entry = 0
    for token in tokens:
        entry = kv_entry(entry, token)
    return entry


class BeamFakeRunner(PipelinedFakeRunner):
    """Applies a step's block copies to the fake KV before it runs; a row asking for logprobs
    gets them from its last position's entry, read back through its block table."""

    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size)
        self.steps: list[SchedulerOutput] = []

    def launch(self, out: SchedulerOutput):
        size = self.block_size
        for src, dst in out.block_copies:
            self.slots[dst * size:(dst + 1) * size] = self.slots[src * size:(src + 1) * size]
        self.steps.append(out)
        return super().launch(out)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        result = super().execute(out)
        rows = [s for s in out.sequences if s.sample]
        return replace(result, logprobs=[
            None if s.params.logprobs is None
            else fake_logprobs(self._read(s.block_ids, s.seq_len - 1), s.params.logprobs)
            for s in rows])


def reference_search(prompt: list[int], params: BeamSearchParams):
    """The search with every beam's logprobs from its whole token list: no KV shared."""
    search, live = BeamSearch(params), [list(prompt)]
    while not search.finished:
        choice = search.advance([fake_logprobs(prefix_entry(tokens), params.num_candidates)
                                 for tokens in live])
        live = [live[parent] + [token] for parent, token in choice]
    return search.result()


def make_engine(block_size=4, num_blocks=64, **config) -> LLMEngine:
    config = EngineConfig.from_flat(block_size=block_size, num_kv_blocks=num_blocks, **config)
    return LLMEngine(config, runner=BeamFakeRunner(num_blocks, block_size))


def run(engine: LLMEngine, requests: dict, abort_after: dict | None = None):
    """Queue, in order, searches ({id: (prompt, BeamSearchParams)}) and ordinary greedy
    requests ({id: (prompt, max_tokens)}), step to the end checking the invariants after every
    step; returns the finished outputs by id, and the ids the scheduler preempted."""
    preempted = []
    preempt = engine.scheduler._preempt
    engine.scheduler._preempt = lambda request: (preempted.append(request.request_id),
                                                 preempt(request))
    for rid, (prompt, params) in requests.items():
        if isinstance(params, BeamSearchParams):
            engine.add_beam_search(rid, prompt, params)
        else:
            engine.add_request(rid, prompt, SamplingParams(max_tokens=params, ignore_eos=True,
                                                           temperature=0.0))
    finals, steps = {}, 0
    while engine.has_unfinished_requests():
        for rid, at in (abort_after or {}).items():
            if steps == at:
                engine.abort(rid)
        finals.update((out.request_id, out) for out in engine.step() if out.finished)
        engine.block_manager.check_invariants()
        engine.scheduler.check_invariants()
        steps += 1
        assert steps < 2000
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.scheduler.beam_searches and not engine.scheduler._beam_of
    return finals, preempted


def assert_searched(output, prompt: list[int], params: BeamSearchParams) -> None:
    want = reference_search(prompt, params)
    got = beam_sequences(output, params)
    assert [s.output_token_ids for s in got] == [list(h.tokens) for h in want]
    assert [s.logprobs for s in got] == [list(h.logprobs) for h in want]
    assert [s.cum_logprob for s in got] == [h.cum_logprob for h in want]
    assert [s.finish_reason for s in got] == ["stop" if h.ended_by_eos else "length"
                                              for h in want]


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 10**6), block_size=st.sampled_from([1, 2, 4]),
       budget=st.integers(1, 24), spare_blocks=st.integers(0, 8), caching=st.booleans(),
       async_scheduling=st.booleans(), num_searches=st.integers(1, 3),
       num_ordinary=st.integers(0, 5), max_num_seqs=st.integers(4, 8))
def test_searches_equal_the_reference_whatever_the_schedule(
        seed, block_size, budget, spare_blocks, caching, async_scheduling, num_searches,
        num_ordinary, max_num_seqs):
    """Small pools make forks preempt ordinary requests, beams wait for blocks and searches
    for their reservation; small budgets split prompts and a search's beams across steps."""
    rng = random.Random(seed)
    requests = {}
    for i in range(num_searches):
        prompt = [rng.randrange(3) for _ in range(rng.randint(1, 10))]
        requests[f"s{i}"] = (prompt, BeamSearchParams(
            beam_width=rng.randint(1, 4), max_tokens=rng.randint(1, 8),
            ignore_eos=rng.random() < 0.3, length_penalty=rng.choice([0.0, 1.0, 2.0]),
            early_stopping=rng.choice([False, True, "never"]), include_stop_str_in_output=True))
    for i in range(num_ordinary):
        requests[f"o{i}"] = ([rng.randrange(3) for _ in range(rng.randint(1, 10))],
                             rng.randint(1, 12))
    order = list(requests)
    rng.shuffle(order)
    largest = max(reserved_blocks(len(prompt), params, block_size)
                  for prompt, params in requests.values()
                  if isinstance(params, BeamSearchParams))
    engine = make_engine(block_size, max(largest, -(-22 // block_size)) + spare_blocks,
                         max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                         enable_prefix_caching=caching, async_scheduling=async_scheduling)
    finals, preempted = run(engine, {rid: requests[rid] for rid in order})
    assert not [rid for rid in preempted if "/beam" in rid], "a beam was preempted"
    for rid, (prompt, params) in requests.items():
        if isinstance(params, BeamSearchParams):
            assert_searched(finals[rid], prompt, params)
        else:
            assert finals[rid].outputs[0].token_ids == reference_output(prompt, params)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_search_step_is_one_decode_token_per_live_beam(async_scheduling):
    """After the prompt's prefill, each step gives each of the B live beams one new token
    (nothing recomputed); forks share the prompt's full blocks and copy its partial one."""
    engine = make_engine(block_size=4, num_blocks=64, async_scheduling=async_scheduling)
    prompt, width = [1, 2, 0, 1, 2, 2, 0, 1, 1, 0], 4  # two full blocks and a partial one
    params = BeamSearchParams(beam_width=width, max_tokens=8, ignore_eos=True,
                              early_stopping="never")
    finals, _ = run(engine, {"s": (prompt, params)})
    assert_searched(finals["s"], prompt, params)
    steps = engine.runner.steps
    assert len(steps) == params.max_tokens
    assert [len(s.token_ids) for s in steps[0].sequences] == [len(prompt)]
    for k, step in enumerate(steps[1:]):
        assert [(len(s.token_ids), s.start_position, s.sample) for s in step.sequences] == \
            [(1, len(prompt) + k, True)] * width
        assert step.apply_before_next  # the next step's tokens are the group's choice
    first = steps[1].sequences
    assert len({s.block_ids[:2] for s in first}) == 1  # the prompt's full blocks, shared
    assert len({s.block_ids[2] for s in first}) == width  # its partial block, copied
    assert sorted(dst for _, dst in steps[1].block_copies) == \
        sorted(s.block_ids[2] for s in first[1:])
    assert {src for src, _ in steps[1].block_copies} == {first[0].block_ids[2]}


def test_ordinary_requests_in_the_same_steps_are_unaffected():
    """Greedy requests batched with searches: every step they share runs both; the ordinary
    requests' tokens are their reference, decoded ahead of the step in flight only while no
    search samples in it."""
    engine = make_engine(block_size=4, num_blocks=96, async_scheduling=True)
    rng = random.Random(7)
    ordinary = {f"o{i}": ([rng.randrange(3) for _ in range(6)], 14) for i in range(3)}
    searches = {f"s{i}": ([rng.randrange(3) for _ in range(5)],
                          BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))
                for i in range(2)}
    finals, preempted = run(engine, {**ordinary, **searches})
    assert not preempted
    for rid, (prompt, max_tokens) in ordinary.items():
        assert finals[rid].outputs[0].token_ids == reference_output(prompt, max_tokens)
    for rid, (prompt, params) in searches.items():
        assert_searched(finals[rid], prompt, params)
    mixed = [s for s in engine.runner.steps
             if {q.request_id[0] for q in s.sequences} == {"o", "s"}]
    assert len(mixed) >= 5
    assert engine.runner.placeholders_filled > 0  # ordinary requests ran ahead once alone


def test_an_aborted_search_frees_everything_and_reports_nothing():
    engine = make_engine(block_size=2, num_blocks=64)
    params = BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True)
    finals, _ = run(engine, {"s": ([1, 2, 0], params), "t": ([2, 2, 1], params),
                             "o": ([1, 1], 12)}, abort_after={"s": 4})
    assert set(finals) == {"t", "o"}
    assert_searched(finals["t"], [2, 2, 1], params)


def test_a_search_that_could_never_fit_is_refused():
    engine = make_engine(block_size=4, num_blocks=8, max_num_seqs=4)
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_beam_search("s", [1, 2, 3], BeamSearchParams(beam_width=4, max_tokens=20))
    with pytest.raises(ValueError, match="sequences"):
        engine.add_beam_search("s", [1, 2, 3], BeamSearchParams(beam_width=5, max_tokens=1))
    with pytest.raises(ValueError, match="maximum context length"):
        engine.add_beam_search("s", [1] * 10, BeamSearchParams(beam_width=2, max_tokens=2048))
    assert not engine.has_unfinished_requests()
