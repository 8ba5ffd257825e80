"""OutputProcessor's output kinds: what an unfinished output carries, and that a finished one
is whole whichever kind asked for it. Fed StepOutputs by hand: no model."""
from __future__ import annotations

import msgspec
import pytest

from engine.core.config import EngineConfig
from engine.core.messages import (AddSequences, EngineStats, NewTokens, SequenceOutput,
                                  StepOutput, ToCore)
from engine.core.request import SamplingParams
from engine.llm import LLMEngine
from engine.output.processor import OutputProcessor
from engine.output.tokenizer import Tokenizer
from fakes import PipelinedFakeRunner

STATS = EngineStats(1, 0, 0.0, 0, 0, 0, 1, 1)


def step(seq_id: str, tokens: list[int], time: float, finished: bool = False) -> StepOutput:
    return StepOutput([SequenceOutput(seq_id, tokens, [time] * len(tokens), None,
                                      "length" if finished else None, None,
                                      time if finished else None, 0.0, 0)], STATS)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer()


def run(tokenizer, output_kind: str):
    """Two steps of a request with two choices: choice 0 ends at the first, choice 1 at the
    second. Returns each step's single RequestOutput."""
    processor = OutputProcessor(tokenizer)
    processor.add("r", None, [1, 2], SamplingParams(n=2, max_tokens=3,
                                                     output_kind=output_kind), 0.0)
    first = StepOutput(step("r#0", [464, 2068], 1.0, finished=True).outputs
                       + step("r#1", [464, 2068], 1.0).outputs, STATS)
    (before,), _ = processor.process(first)
    (after,), _ = processor.process(step("r#1", [7586], 2.0, finished=True))
    return before, after


def test_a_delta_request_gets_deltas_until_its_choice_finishes(tokenizer):
    first, last = run(tokenizer, "delta")
    done, running = first.outputs
    assert done.token_ids == [464, 2068] and done.text == "The quick"  # finished: whole
    assert running.token_ids == [] and running.text == "" and first.metrics[1].token_times == []
    assert running.delta_token_ids == [464, 2068] and running.delta_text == "The quick"
    assert [c.token_ids for c in last.outputs] == [[464, 2068], [464, 2068, 7586]]
    assert last.outputs[1].text == "The quick brown" and last.finished
    assert last.metrics[1].token_times == [1.0, 1.0, 2.0]


def test_a_stream_request_gets_cumulative_snapshots(tokenizer):
    first, last = run(tokenizer, "stream")
    running = first.outputs[1]
    assert running.token_ids == [464, 2068] and running.text == "The quick"
    assert first.metrics[1].token_times == [1.0, 1.0]
    assert last.outputs[1].token_ids == [464, 2068, 7586]
    assert running.token_ids == [464, 2068]  # the earlier snapshot did not grow


def test_final_only_requests_get_one_output(tokenizer):
    """Its text is decoded once at the end, from every step's tokens (a step may bring
    several), the end-of-text token adding none."""
    processor = OutputProcessor(tokenizer)
    processor.add("r", None, [1], SamplingParams(max_tokens=4, output_kind="final_only"), 0.0)
    assert processor.process(step("r#0", [464], 1.0))[0] == []
    (last,), _ = processor.process(step("r#0", [2068, 7586, 50256], 2.0, finished=True))
    assert last.token_ids == [464, 2068, 7586, 50256] and last.finished
    assert last.outputs[0].text == "The quick brown"


def test_an_unknown_output_kind_is_refused():
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="deltas")


def test_steps_applied_together_give_one_output_with_all_their_deltas(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add("r", None, [1], SamplingParams(max_tokens=3, output_kind="delta"), 0.0)
    (output,), _ = processor.process(step("r#0", [464], 1.0), step("r#0", [2068], 2.0),
                                     step("r#0", [7586], 3.0, finished=True))
    choice = output.outputs[0]
    assert choice.delta_token_ids == [464, 2068, 7586] and choice.delta_text == "The quick brown"
    assert choice.token_ids == [464, 2068, 7586] and output.finished
    assert output.metrics[0].token_times == [1.0, 2.0, 3.0]


def test_the_cache_salt_reaches_the_prefix_cache(tokenizer):
    """add(cache_salt=...) tags every choice's sequence, through msgpack too (the server's
    way to the core), and the core serves a prefix only to requests of the same salt."""
    params = SamplingParams(n=2, max_tokens=2, output_kind="final_only")
    sequences = OutputProcessor(tokenizer).add("r", None, [1, 2], params, 0.0, cache_salt="t")
    wire = msgspec.msgpack.Decoder(ToCore).decode(
        msgspec.msgpack.encode(AddSequences(sequences)))
    assert [seq.cache_salt for seq in wire.sequences] == ["t", "t"]

    engine = LLMEngine(EngineConfig.from_flat(block_size=4, num_kv_blocks=32),
                       runner=PipelinedFakeRunner(32, 4))
    prompt, params = list(range(9)), SamplingParams(max_tokens=2, output_kind="final_only")
    cached = {}
    for rid, salt in [("first", "t1"), ("other", "t2"), ("none", None), ("same", "t1")]:
        engine.add_request(rid, prompt, params, cache_salt=salt)
        while engine.has_unfinished_requests():  # one at a time: each sees the ones before
            for out in engine.step():
                cached[rid] = out.metrics[0].num_cached_tokens
    assert cached == {"first": 0, "other": 0, "none": 0, "same": 8}


@pytest.mark.parametrize("stop", [(), (" brown",)])
def test_new_tokens_columns_give_what_sequence_outputs_give(tokenizer, stop):
    """The same tokens sent as NewTokens rows (after a first SequenceOutput) and as one
    SequenceOutput each: the same outputs, and a stop string completed in a row ends the
    choice and asks the core to abort it."""
    def outputs(as_columns: bool):
        processor = OutputProcessor(tokenizer)
        processor.add("r", None, [1, 2], SamplingParams(max_tokens=9, stop=stop), 0.0)
        results = [processor.process(step("r#0", [464], 1.0))]
        for time, token in ((2.0, 2068), (3.0, 7586), (4.0, 21831)):
            if as_columns:
                message = StepOutput([], STATS, NewTokens(["r#0"], [token], [time]))
            else:
                message = step("r#0", [token], time)
            results.append(processor.process(message))
        return results

    columns, rows = outputs(True), outputs(False)
    assert columns == rows
    final, to_abort = columns[-2] if stop else columns[-1]
    assert final[0].outputs[0].text == ("The quick" if stop else "The quick brown fox")
    assert to_abort == (["r#0"] if stop else [])


def test_a_steady_decode_step_reports_its_rows_as_new_tokens(tokenizer):
    """Delta outputs through the core: first and last tokens as SequenceOutputs, the ones
    between as NewTokens rows, and the text is whole."""
    engine = LLMEngine(EngineConfig.from_flat(max_num_seqs=4, num_kv_blocks=64, block_size=16),
                       runner=PipelinedFakeRunner(64, 16))
    steps = []
    real_step = engine.core.step
    engine.core.step = lambda: steps.append(real_step()) or steps[-1]
    params = SamplingParams(max_tokens=6, ignore_eos=True, output_kind="final_only")
    engine.add_request("a", [464, 2068], SamplingParams(max_tokens=6, ignore_eos=True))
    engine.add_request("b", [464, 2068], params)
    done = {}
    while engine.has_unfinished_requests():
        done.update((out.request_id, out) for out in engine.step() if out.finished)
    rows = [seq_id for s in steps if s.new_tokens for seq_id in s.new_tokens.seq_ids]
    assert rows == ["a#0"] * 4  # tokens 2-5 of a; b defers its outputs to its end
    first_and_last = [o.seq_id for s in steps for o in s.outputs]
    assert sorted(first_and_last) == ["a#0", "a#0", "b#0"]
    assert len(done["a"].outputs[0].token_ids) == 6
    assert done["a"].outputs[0].token_ids == done["b"].outputs[0].token_ids
