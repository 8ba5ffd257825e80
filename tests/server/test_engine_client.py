"""EngineClient against a scripted core: steps that arrive together are applied together."""
from __future__ import annotations

import asyncio

from engine.core.messages import (AddSequences, EngineStats, SequenceFailed, SequenceOutput,
                                  StepOutput)
from engine.core.request import SamplingParams
from engine.output.tokenizer import Tokenizer
from fakes import ScriptedCore
from server.engine_client import EngineClient, RequestFailed

STATS = EngineStats(1, 0, 0.0, 0, 0, 0, 1, 1)


def token_step(seq_id: str, token: int, time: float, finished: bool = False) -> StepOutput:
    return StepOutput([SequenceOutput(seq_id, [token], [time], None,
                                      "length" if finished else None, None,
                                      time if finished else None, 0.0, 0)], STATS)


def run_generation(*script: str):
    """Outputs (batches of the Generation) of one 3-token request while the core delivers
    `script`: "steps" (all three steps at once) or "fail-after-two"."""
    async def main():
        core = ScriptedCore()
        engine = EngineClient(core, Tokenizer(), 16)
        engine.start()
        generation = engine.generate("r", [[1, 2]], SamplingParams(max_tokens=3,
                                                                    output_kind="delta"))
        (sent,) = core.sent
        assert isinstance(sent, AddSequences)
        seq_id = sent.sequences[0].seq_id
        for i, token in enumerate((464, 2068, 7586)[:3 if script == ("steps",) else 2]):
            core.deliver(token_step(seq_id, token, float(i), finished=i == 2))
        if script == ("fail-after-two",):
            core.deliver(SequenceFailed(seq_id, "boom"))
        batches = []
        try:
            async for ready in generation:
                batches.append(ready)
        except RequestFailed as failure:
            batches.append(failure)
        return batches
    return asyncio.run(main())


def test_steps_delivered_together_reach_the_stream_as_one_output():
    (batch,) = run_generation("steps")
    ((_, output),) = batch
    assert output.outputs[0].delta_token_ids == [464, 2068, 7586] and output.finished


def test_a_failure_comes_after_the_steps_delivered_before_it():
    first, failure = run_generation("fail-after-two")
    ((_, output),) = first
    assert output.outputs[0].delta_token_ids == [464, 2068]
    assert isinstance(failure, RequestFailed) and "boom" in str(failure)
