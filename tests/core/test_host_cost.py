"""Host work per steady decode step, counted rather than timed: the Python bytecodes the
engine core (engine/core: scheduler, block manager, EngineCore) executes per sequence per
step. A count is the same on any machine, so a shared 2-core CI runner catches what a timer
would blur: per-sequence work that grows, or work that grows faster than the batch. The step
messages' own code (engine/core/batch.py: a continued step's expansion, ScheduledSequence's
properties) is not counted: it runs on the runner's side, here the fake runner's."""
from __future__ import annotations

import sys
from pathlib import Path

from fakes import PipelinedFakeRunner

import engine.core
from engine.core.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.messages import CoreRequest
from engine.core.request import SamplingParams

CORE_DIR = str(Path(engine.core.__file__).parent)
MESSAGES_FILE = str(Path(engine.core.__file__).parent / "batch.py")
# bytecodes per sequence per decode step of EngineCore.step with nothing but one new token per
# sequence; 187 when this bound was set (592 before the decode fast paths, 468 before
# the decode-ahead row, 357 before the steady decode step, 267 before continuations and the
# inlined update): the margin is for harmless edits
MAX_OPCODES_PER_SEQUENCE = 190


def opcodes_per_sequence(batch: int, steps: int = 8) -> float:
    """Bytecodes executed in engine/core per sequence per step, over `steps` decode steps of
    `batch` running sequences (async scheduling, final-only outputs: the offline path)."""
    config = EngineConfig.from_flat(max_num_seqs=batch, num_kv_blocks=batch * 8, block_size=16,
                                    max_num_batched_tokens=max(batch * 16, 256))
    core = EngineCore(config, PipelinedFakeRunner(batch * 8, 16))
    params = SamplingParams(max_tokens=64, ignore_eos=True, output_kind="final_only")
    for i in range(batch):
        core.add(CoreRequest(f"s{i}", [i % 90, 1, 2, 3, 4, 5, 6, 7], params, 0.0))
    for _ in range(4):  # prefill, then decode ahead of the step in flight
        core.step()
    count = 0

    def trace_lines(frame, event, arg):
        nonlocal count
        if event == "opcode":
            count += 1
        return trace_lines

    def trace_calls(frame, event, arg):
        filename = frame.f_code.co_filename
        if not filename.startswith(CORE_DIR) or filename == MESSAGES_FILE:
            return None
        frame.f_trace_opcodes = True
        return trace_lines

    sys.settrace(trace_calls)
    try:
        for _ in range(steps):
            core.step()
    finally:
        sys.settrace(None)
    assert all(r.num_output_tokens < params.max_tokens for r in core.scheduler.running)
    return count / steps / batch


def test_decode_step_work_per_sequence_is_bounded():
    per_sequence = opcodes_per_sequence(256)
    print(f"{per_sequence:.0f} bytecodes per sequence per decode step at batch 256")
    assert per_sequence <= MAX_OPCODES_PER_SEQUENCE


def test_decode_step_work_grows_linearly_with_the_batch():
    small, large = opcodes_per_sequence(32), opcodes_per_sequence(256)
    assert large <= 1.05 * small, (small, large)
