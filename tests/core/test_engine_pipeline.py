"""LLMEngine.step(), with and without scheduling ahead, under random arrivals, aborts and stop
strings, with the prefix-dependent fake runner (fakes.py, no torch): every request
ends exactly once, its tokens are a prefix of the reference, stop strings cut the text, and
no block leaks."""
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.config import EngineConfig
from engine.llm import LLMEngine
from engine.core.request import SamplingParams
from engine_workload import run_random_workload
from fakes import PipelinedFakeRunner, reference_output


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), num_blocks=st.integers(12, 40),
       budget=st.integers(1, 24), final_only=st.booleans(), async_scheduling=st.booleans())
def test_pipelined_engine_random_workloads(seed, num_blocks, budget, final_only,
                                           async_scheduling):
    config = EngineConfig.from_flat(block_size=4, num_kv_blocks=num_blocks, max_num_seqs=4,
                                    max_num_batched_tokens=budget,
                                    async_scheduling=async_scheduling)
    engine = LLMEngine(config, runner=PipelinedFakeRunner(num_blocks, 4))
    run_random_workload(engine, random.Random(seed), "final_only" if final_only else "stream")
    assert engine.block_manager.num_free_blocks == num_blocks


def test_request_id_reused_after_abort_gets_only_its_own_tokens():
    """A token sampled for an aborted request arrives one step late; a new request that took
    the same id meanwhile must not receive it."""
    config = EngineConfig.from_flat(block_size=4, num_kv_blocks=32, max_num_seqs=4,
                                    async_scheduling=True)
    engine = LLMEngine(config, runner=PipelinedFakeRunner(32, 4))
    params = SamplingParams(max_tokens=3, ignore_eos=True, output_kind="final_only")
    engine.add_request("x", [5, 6, 7], params)
    engine.step()  # x's first token is sampled; its output is handled next step
    engine.abort("x")
    engine.add_request("x", [1, 2], params)
    finals = []
    while engine.has_unfinished_requests():
        finals += [out for out in engine.step() if out.finished]
    [out] = finals
    assert out.error is None and out.outputs[0].token_ids == reference_output([1, 2], 3)
    assert engine.runner.placeholders_filled > 0  # decode steps were scheduled ahead
