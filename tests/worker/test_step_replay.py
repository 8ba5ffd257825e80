"""A step is described by its SchedulerOutput alone: the steps of a real engine run with async
scheduling, recorded as pickled bytes, replay through a fresh runner to the same tokens."""
from __future__ import annotations

import pickle
import random

import pytest

from engine import LLM, SamplingParams
from engine.core.batch import StepRows
from engine.core.config import EngineConfig
from engine.build import build_runner
from fakes import RecordingRunner

PARAMS = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
          SamplingParams(temperature=0.9, max_tokens=8, ignore_eos=True),
          SamplingParams(temperature=1.2, seed=5, max_tokens=8, ignore_eos=True),
          SamplingParams(top_k=5, max_tokens=8, ignore_eos=True)]


@pytest.fixture(scope="module")
def recorded(tiny_checkpoint) -> tuple[RecordingRunner, EngineConfig]:
    """A 16-token budget mixes prompt chunks with decodes."""
    rng = random.Random(4)
    prompts = [[rng.randrange(50256) for _ in range(rng.randint(1, 30))] for _ in range(5)]
    llm = LLM(model=str(tiny_checkpoint), device="cpu", dtype="float32", max_num_seqs=4,
              max_num_batched_tokens=16, num_kv_blocks=64, block_size=8,
              attention_backend="torch", async_scheduling=True)
    recorder = RecordingRunner(llm.engine.runner)
    llm.engine.core.runner = recorder
    llm.generate(prompts, [PARAMS[i % len(PARAMS)] for i in range(len(prompts))],
                 use_tqdm=False)
    return recorder, llm.engine.config


def test_recorded_steps_replay_through_a_fresh_runner(recorded):
    """Each placeholder names its own request's row of the step before; replayed, the steps
    (continuations among them, which name only what changed) give the recorded tokens
    (unseeded rows take seeds from the runner's generator, which a fresh runner with the
    same config seed repeats)."""
    recorder, config = recorded
    steps = [pickle.loads(raw) for raw in recorder.steps]
    assert any(step.continued is not None for step in steps)
    step_rows = StepRows()
    expanded = [step_rows.full(step) for step in steps]
    placeholders = 0
    for prev, prev_out, step in zip(expanded, recorder.outputs, expanded[1:]):
        for seq in (s for s in step.sequences if s.prev_sample_row >= 0):
            assert prev.step_id == step.step_id - 1
            assert prev_out.request_ids[seq.prev_sample_row] == seq.request_id
            placeholders += 1
    assert placeholders > 12  # most decodes were scheduled ahead

    fresh = build_runner(config)
    assert [fresh.execute(step) for step in steps] == recorder.outputs


def test_a_step_whose_placeholders_name_another_launch_is_refused(recorded):
    recorder, config = recorded
    steps = [pickle.loads(raw) for raw in recorder.steps]
    k = next(i for i, step in enumerate(steps)
             if any(s.prev_sample_row >= 0 for s in step.sequences))
    runner = build_runner(config)
    for step in steps[:k - 1]:  # step k - 1, whose samples step k reads, is left out
        runner.execute(step)
    with pytest.raises(RuntimeError, match="placeholder tokens"):
        runner.execute(steps[k])
