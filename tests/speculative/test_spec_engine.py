"""Speculative decoding in the engine (CPU, tiny random GPT-2): output token for token the same
as without it, greedy (n-gram proposer) and seeded-sampled (scripted drafts), in mixed batches,
with prefix caching, 7-token chunks, preemption and either scheduling mode; stops inside an
accepted run; no KV kept for rejected drafts; the switch-off; the counters."""

import pytest

from engine import SamplingParams
from engine.speculative.switch import SpeculationSwitch, StepTimes
from fakes import ScriptedProposer, drafts_at_rate
from spec_cases import (EACH_SETTING, GREEDY, K, NGRAM, assert_all_blocks_free,
                        make_llm, mixed_params)

@EACH_SETTING
def test_ngram_speculation_changes_no_greedy_token(tiny_checkpoint, prompts, plain_greedy,
                                                   overrides):
    llm = make_llm(tiny_checkpoint, speculative_config=NGRAM, **overrides)
    outputs = llm.generate(prompts, mixed_params(prompts), use_tqdm=False)
    assert [o.token_ids for o in outputs] == plain_greedy
    stats = llm.engine.core.speculator.stats
    assert stats.num_accepted_tokens > 0  # the prompts repeat: speculation really ran
    if "num_kv_blocks" in overrides:
        assert llm.engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(llm)


def test_the_second_prompt_reuses_the_first_ones_cached_blocks(tiny_checkpoint, prompts):
    """Blocks registered in the prefix cache by a speculating request hold the right KV: a
    later request that hits them decodes as an uncached one does."""
    prompt = prompts[2] + prompts[2][:7]
    fresh = make_llm(tiny_checkpoint, enable_prefix_caching=False)
    expected = fresh.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids
    llm = make_llm(tiny_checkpoint, speculative_config=NGRAM, block_size=4)
    first = llm.generate([prompts[2]], GREEDY, use_tqdm=False)[0]
    hits = llm.engine.block_manager.prefix_hits
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids == expected
    assert llm.engine.block_manager.prefix_hits > hits and first.token_ids


def oracle_llm(checkpoint, references, rate, **overrides):
    """An engine whose proposer drafts references[i] for request i (LLM ids count from 0,
    one sequence each: "{i}#0"), each token kept with probability `rate`."""
    llm = make_llm(checkpoint, speculative_config=NGRAM, **overrides)
    proposer = llm.engine.core.speculator.proposer = ScriptedProposer()
    for i, reference in enumerate(references):
        proposer.add(f"{i}#0", drafts_at_rate(reference, rate, seed=1, vocab_size=50257))
    return llm


@pytest.mark.parametrize("rate", [0.0, 0.6, 1.0])
def test_seeded_sampled_requests_are_unchanged_by_speculation(tiny_checkpoint, prompts,
                                                              seeded, rate):
    """A one-hot draft is judged by the very draw plain decoding makes at its position, so
    a seeded request's tokens are the same whatever was proposed."""
    params, references = seeded
    llm = oracle_llm(tiny_checkpoint, references, rate)
    got = llm.generate(prompts[:3], params, use_tqdm=False)
    assert [o.token_ids for o in got] == references
    stats = llm.engine.core.speculator.stats
    assert stats.num_draft_tokens > 0
    if rate == 1.0:
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    elif rate == 0.0:
        assert stats.num_accepted_tokens == 0
    else:
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert_all_blocks_free(llm)


def test_stops_inside_an_accepted_run_end_the_request_there(tiny_checkpoint, prompts):
    """Every draft is accepted (k + 1 tokens a step), yet a stop token id, a stop string and
    max_tokens each end the output exactly where plain decoding ends it."""
    long = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain = make_llm(tiny_checkpoint).generate(prompts, long, use_tqdm=False)
    references = [o.token_ids for o in plain]
    text = plain[4].text
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                             stop_token_ids=[references[0][6]]),
              SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                             stop=[text[len(text) // 2:][:4]]),
              long, long]
    expected = make_llm(tiny_checkpoint).generate(prompts, params, use_tqdm=False)
    llm = oracle_llm(tiny_checkpoint, references, 1.0)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [(o.token_ids, o.text, o.finish_reason) for o in got] == [
        (o.token_ids, o.text, o.finish_reason) for o in expected]
    assert expected[1].finish_reason == "length" and len(expected[1].token_ids) == 7
    assert llm.engine.core.speculator.stats.num_accepted_tokens > 0
    assert_all_blocks_free(llm)


def test_no_block_is_kept_for_rejected_drafts(tiny_checkpoint, prompts):
    """After every applied step a request holds exactly the blocks its computed tokens need
    (as a plain decoding request does: its last token has no KV yet)."""
    llm = oracle_llm(tiny_checkpoint, [[0] * 20] * len(prompts), 0.0, block_size=2,
                     async_scheduling=False)  # drafts of token 0 and corruptions: rejected
    engine, bm = llm.engine, llm.engine.block_manager
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
        for request in engine.scheduler.running:
            assert (len(bm.block_ids(request.request_id))
                    == bm.blocks_needed(request.num_computed_tokens))
    stats = engine.core.speculator.stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens


def test_switch_off_stops_drafting_at_a_batch_where_verifying_costs_more(tiny_checkpoint,
                                                                         prompts, plain_greedy):
    """Given step times where verifying 5 rows of k + 1 tokens costs 10x a decode step,
    speculation pays at batch 1 only: the batch of five never drafts, one request does."""
    times = StepTimes((1, 5), plain=(1.0, 1.0), speculative={K: (1.0, 10.0)})
    llm = make_llm(tiny_checkpoint, speculative_config=NGRAM)
    speculator = llm.engine.core.speculator
    speculator.switch = SpeculationSwitch(times)
    outputs = llm.generate(prompts, mixed_params(prompts), use_tqdm=False)
    assert [o.token_ids for o in outputs] == plain_greedy
    drafted_in_batch = speculator.stats.num_drafts
    llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    assert speculator.stats.num_drafts > drafted_in_batch
    assert drafted_in_batch < len(prompts) * GREEDY.max_tokens // 4  # only as the batch drained


def test_metrics_name_the_spec_counters_and_they_add_up(tiny_checkpoint, prompts):
    llm = make_llm(tiny_checkpoint, speculative_config=NGRAM)
    llm.generate(prompts, GREEDY, use_tqdm=False)
    metrics = {m.name: m for m in llm.get_metrics()}
    drafts = metrics["vllm:spec_decode_num_drafts"].value
    draft_tokens = metrics["vllm:spec_decode_num_draft_tokens"].value
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"].value
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values
    assert 0 < accepted <= draft_tokens and drafts <= draft_tokens <= K * drafts
    assert len(per_pos) == K and sum(per_pos) == accepted and per_pos[0] <= drafts
    assert metrics["vllm:num_preemptions"].value == 0
    assert not [m for m in make_llm(tiny_checkpoint).get_metrics()
                if m.name.startswith("vllm:spec_decode")]


def test_an_aborted_speculating_request_frees_everything(tiny_checkpoint, prompts):
    engine = make_llm(tiny_checkpoint, speculative_config=NGRAM).engine
    engine.add_request("a", prompts[0], SamplingParams(temperature=0.0, max_tokens=100))
    for _ in range(4):
        engine.step()
    engine.abort("a")
    assert engine.scheduler.requests == {}
    while engine.core.has_unfinished():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert "a" not in engine.core.speculator.proposer  # its n-gram index is released


def test_step_times_are_measured_for_each_batch_size_and_draft_length(tiny_checkpoint):
    """The switch-off's cost model, measured as on a GPU at startup (there by the runner
    itself): every batch size whose verification step fits the token budget, every k."""
    from engine.speculative.timing import measure_step_times

    llm = make_llm(tiny_checkpoint, speculative_config=NGRAM, max_num_seqs=6,
                   max_num_batched_tokens=20)
    config = llm.engine.config
    assert llm.engine.core.speculator.switch is None  # CPU: no switch-off
    times = measure_step_times(llm.engine.runner, config.speculative, config.scheduler,
                               repeats=1)
    assert times.batch_sizes == (1, 2, 4)  # 4 rows of k + 1 = 5 tokens fill the budget
    assert sorted(times.speculative) == [1, 2, 3, 4]
    assert all(t > 0 for series in times.speculative.values() for t in series)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_plain_steps_are_timed_as_the_loop_runs_them(async_scheduling):
    """The switch-off compares a speculative step, applied before the next is scheduled,
    with plain steps as the loop runs them: pipelined with async scheduling (every launch
    before the first wait), one at a time without it; speculative steps one at a time."""
    from engine.core.config import SchedulerConfig, SpeculativeConfig
    from engine.speculative.timing import measure_step_times

    events = []

    class Pending:
        def __init__(self, drafts: int) -> None:
            self.drafts = drafts

        def wait(self):
            events.append(("wait", self.drafts))

    class Runner:
        block_size, num_kv_blocks = 16, 64

        def launch(self, out):
            events.append(("launch", out.num_draft_tokens))
            return Pending(out.num_draft_tokens)

        def execute(self, out):
            return self.launch(out).wait()

    sched = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64,
                            async_scheduling=async_scheduling)
    measure_step_times(Runner(), SpeculativeConfig(num_speculative_tokens=1), sched, repeats=3)
    plain = [kind for kind, drafts in events if not drafts]
    timed = plain[2:]  # after the warm-up's launch and wait
    assert timed == (["launch"] * 3 + ["wait"] * 3 if async_scheduling
                     else ["launch", "wait"] * 3)
    speculative = [kind for kind, drafts in events if drafts]
    assert speculative == ["launch", "wait"] * 4


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_constrained_requests_never_speculate_beside_ones_that_do(tiny_checkpoint, prompts,
                                                                  plain_greedy,
                                                                  async_scheduling):
    """A structured-output request takes no drafts (its tokens must pass its grammar one by
    one): it decodes plainly, under its mask, in the steps where the others speculate. The
    others' tokens stay those of decoding without speculation, and every constrained output
    matches its regex."""
    import re

    from engine import StructuredOutputsParams

    llm = make_llm(tiny_checkpoint, speculative_config=NGRAM,
                   async_scheduling=async_scheduling)
    constrained = SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=(
        StructuredOutputsParams(regex="[a-z]{4,12}")))
    outputs = llm.generate(prompts + prompts[:2], mixed_params(prompts) + [constrained] * 2,
                           use_tqdm=False)
    assert [o.token_ids for o in outputs[:len(prompts)]] == plain_greedy
    for out in outputs[len(prompts):]:
        assert re.fullmatch("[a-z]{4,12}", out.outputs[0].text), out.outputs[0].text
    assert llm.engine.core.speculator.stats.num_accepted_tokens > 0
    assert_all_blocks_free(llm)
