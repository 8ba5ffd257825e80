"""LLMEngine.step(), with and without scheduling ahead, under random arrivals, aborts and stop
strings, with the prefix-dependent fake runner from test_scheduler (no torch): every request
ends exactly once, its tokens are a prefix of the reference, stop strings cut the text, and
no block leaks."""
import random
from dataclasses import dataclass, replace

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.batch import PLACEHOLDER_TOKEN, RunnerOutput, SchedulerOutput
from engine.core.config import EngineConfig
from engine.llm import LLMEngine
from engine.core.request import SamplingParams
from engine.output.tokenizer import Tokenizer
from test_scheduler import FakeRunner, reference_output


@dataclass(frozen=True)
class CompletedStep:
    """What a fake runner that runs each step at launch returns from launch(): a pending
    step whose wait() has nothing to wait for."""
    result: RunnerOutput

    def wait(self) -> RunnerOutput:
        return self.result


class PipelinedFakeRunner(FakeRunner):
    """Runs each step at launch; a placeholder token becomes the token in row
    prev_sample_row of what the previous launch (step step_id - 1) sampled, as the real runner
    reads it from the device. A wrong row gives a wrong token, so outputs differ from the
    reference."""

    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size)
        self.num_kv_blocks = num_blocks
        self.last: tuple[int, list[int]] | None = None  # (step id, sampled tokens)
        self.placeholders_filled = 0

    def launch(self, out: SchedulerOutput) -> CompletedStep:
        resolved = []
        for seq in out.sequences:
            assert (seq.prev_sample_row >= 0) == (seq.token_ids == [PLACEHOLDER_TOKEN])
            if seq.prev_sample_row >= 0:
                step_id, sampled = self.last
                assert step_id == out.step_id - 1
                seq = replace(seq, token_ids=[sampled[seq.prev_sample_row]])
                self.placeholders_filled += 1
            assert PLACEHOLDER_TOKEN not in seq.token_ids
            resolved.append(seq)
        result = self.execute(replace(out, sequences=resolved))
        self.last = (out.step_id, result.sampled_token_ids)
        return CompletedStep(result)


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


def run_random_workload(engine: LLMEngine, rng: random.Random, output_kind: str = "stream",
                        on_add=lambda seq_id, reference: None) -> None:
    """Requests arrive over 30 steps (on_add sees each one's sequence id and reference
    output), some are aborted, the engine runs dry; every request ends exactly once with a
    prefix of its reference, cut by its stop string or max_tokens."""
    text_of = Tokenizer().decode
    expected, aborted, finals = {}, set(), {}
    for step in range(600):
        if step < 30 and rng.random() < 0.4:
            prompt = [rng.randrange(90) for _ in range(rng.randint(1, 10))]
            stop = (rng.choice("ABCDEFGH"),) if rng.random() < 0.5 else ()
            params = SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True, stop=stop,
                                    output_kind=output_kind)
            expected[f"r{step}"] = (reference_output(prompt, params.max_tokens), stop)
            on_add(f"r{step}#0", expected[f"r{step}"][0])
            engine.add_request(f"r{step}", prompt, params)
        if engine.has_unfinished_requests() and rng.random() < 0.05:
            rid = rng.choice(sorted(engine.processor._groups))
            engine.abort(rid)
            aborted.add(rid)
        for out in engine.step():
            assert out.request_id not in finals, "output after the request finished"
            if out.finished:
                finals[out.request_id] = out
        engine.block_manager.check_invariants()
        if step >= 30 and not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests()
    assert set(finals) | aborted == set(expected)
    for rid, out in finals.items():
        tokens, stop = expected[rid]
        assert out.token_ids == tokens[:len(out.token_ids)]
        full = text_of(tokens)
        if stop and stop[0] in full:
            assert out.finish_reason == "stop" and out.text == full[:full.index(stop[0])]
        else:
            assert out.finish_reason == "length" and out.token_ids == tokens


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
