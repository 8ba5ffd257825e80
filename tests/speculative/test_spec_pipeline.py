"""Speculative decoding in LLMEngine.step() under random arrivals, aborts, stop strings,
chunking and preemption, with the prefix-dependent fake runner (no torch) taught to verify
drafts as the real one does: a scripted proposer drafts each request's reference output with
corruptions, and every request must still end with a prefix of its reference, exactly once,
leaking no block."""
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.batch import RunnerOutput, SchedulerOutput
from engine.core.config import EngineConfig
from engine.core.request import SamplingParams
from engine.llm import LLMEngine
from engine_workload import run_random_workload
from fakes import (VOCAB, CompletedStep, PipelinedFakeRunner, ScriptedProposer, drafts_at_rate,
                   next_token)

K = 3


class VerifyingFakeRunner(PipelinedFakeRunner):
    """A sequence with d drafts samples at its last d + 1 positions (the fake model's token
    after each prefix) and accepts its drafts while they equal those samples."""

    def launch(self, out: SchedulerOutput) -> CompletedStep:
        result = super().launch(out).result
        if not out.num_draft_tokens:
            return CompletedStep(result)
        sampled, accepted = [], []
        for seq in (s for s in out.sequences if s.sample):
            drafts = seq.token_ids[len(seq.token_ids) - seq.num_drafts:]
            first = seq.seq_len - seq.num_drafts - 1  # position of the last known token
            draws = [next_token(self._read(seq.block_ids, first + i))
                     for i in range(seq.num_drafts + 1)]
            n = next((i for i, d in enumerate(drafts) if d != draws[i]), len(drafts))
            sampled.append(draws[n])
            accepted.append(drafts[:n])
        result = RunnerOutput(result.request_ids, sampled, result.logprobs, accepted)
        self.last = (out.step_id, sampled)
        return CompletedStep(result)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), num_blocks=st.integers(12, 40),
       budget=st.integers(K + 1, 24), rate=st.sampled_from([0.0, 0.5, 0.9, 1.0]),
       async_scheduling=st.booleans())
def test_speculating_engine_random_workloads(seed, num_blocks, budget, rate,
                                             async_scheduling):
    stats = run_workload(seed, num_blocks, budget, rate, async_scheduling)
    assert stats.num_accepted_tokens <= stats.num_draft_tokens
    if rate == 0.0:
        assert stats.num_accepted_tokens == 0


def test_a_roomy_workload_accepts_drafts():
    stats = run_workload(seed=1, num_blocks=40, budget=24, rate=1.0, async_scheduling=True)
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0


def run_workload(seed, num_blocks, budget, rate, async_scheduling):
    """test_engine_pipeline's random workload, speculating; returns the counters."""
    config = EngineConfig.from_flat(block_size=4, num_kv_blocks=num_blocks, max_num_seqs=4,
                                    max_num_batched_tokens=budget,
                                    async_scheduling=async_scheduling,
                                    speculative_config={"num_speculative_tokens": K})
    engine = LLMEngine(config, runner=VerifyingFakeRunner(num_blocks, 4))
    proposer = engine.core.speculator.proposer = ScriptedProposer()
    run_random_workload(engine, random.Random(seed), on_add=lambda seq_id, reference:
                        proposer.add(seq_id, drafts_at_rate(reference, rate, seed, VOCAB)))
    assert engine.block_manager.num_free_blocks == num_blocks
    return engine.core.speculator.stats


def test_a_request_that_may_speculate_keeps_pace_beside_one_running_ahead():
    """Its proposer finds nothing, so its steps hold no drafts; still each is applied before
    the next is scheduled, so it decodes every step, as the request with logprobs (which
    never speculates, so may run ahead) does, instead of every other."""
    config = EngineConfig.from_flat(block_size=4, num_kv_blocks=64, max_num_seqs=4,
                                    async_scheduling=True,
                                    speculative_config={"num_speculative_tokens": K})
    engine = LLMEngine(config, runner=VerifyingFakeRunner(64, 4))
    engine.core.speculator.proposer = ScriptedProposer()  # scripts no request: no drafts
    engine.add_request("may", [1, 2, 3], SamplingParams(max_tokens=12, ignore_eos=True))
    engine.add_request("ahead", [4, 5, 6], SamplingParams(max_tokens=12, ignore_eos=True,
                                                          logprobs=1))
    finished_at, step = {}, 0
    while engine.has_unfinished_requests():
        step += 1
        finished_at.update({o.request_id: step for o in engine.step() if o.finished})
    assert abs(finished_at["may"] - finished_at["ahead"]) <= 1
