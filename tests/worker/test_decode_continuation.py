"""DecodeStager.write_continued, which stages a decode step of placeholder rows from the step
its peer staged just before (positions, block tables by index; only rows starting a block read
their block ids, from the rows or, for a step sent as a DecodeContinuation, from its new
blocks), stages what write() stages from the rows themselves: checked on every decode step of
random async workloads through the real scheduler, with preemption (few blocks), aborts,
requests finishing and arriving, and rows moving between steps."""
import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.batch import StepRows
from engine.core.config import EngineConfig
from engine.llm import LLMEngine
from engine.worker.cuda_graphs import Continued, DecodeStager, decode_meta_layout
from engine.worker.cuda_graphs.buffers import token_layout
from engine.worker.model_runner import continued_rows
from engine_workload import run_random_workload
from fakes import PipelinedFakeRunner

ROWS, WIDTH, BLOCK = 4, 8, 4


class RecordingRunner(PipelinedFakeRunner):
    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size)
        self.steps = []

    def launch(self, out):
        self.steps.append(out)
        return super().launch(out)


def stager() -> DecodeStager:
    """A stager over zeroed host arrays shaped like the decode graphs' pinned mirrors."""
    return DecodeStager(token_layout(ROWS).views(np.full(token_layout(ROWS).size, 99)),
                        decode_meta_layout(ROWS, WIDTH).views(
                            np.full(decode_meta_layout(ROWS, WIDTH).size, 99, np.int32)),
                        BLOCK)


def staged(s: DecodeStager, seqs, size: int) -> dict:
    """What the graph reads of a staged step: every token row, and each row's table up to its
    blocks (entries past them may be stale)."""
    t, m = s.tokens, s.meta
    return {"token_ids": t.token_ids[:size].tolist(), "positions": t.positions[:size].tolist(),
            "slots": t.slot_mapping[:size].tolist(), "source": t.token_source[:size].tolist(),
            "seeds": t.draw_seeds[:size].tolist(), "seq_lens": m.seq_lens[:size].tolist(),
            "tables": [m.block_tables[row, :len(q.block_ids)].tolist()
                       for row, q in enumerate(seqs)],
            "padding_tables": m.block_tables[len(seqs):size, 0].tolist()}


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), num_blocks=st.integers(10, 30))
def test_continued_staging_equals_staging_from_the_rows(seed, num_blocks):
    config = EngineConfig.from_flat(block_size=BLOCK, num_kv_blocks=num_blocks,
                                    max_num_seqs=ROWS, max_num_batched_tokens=16,
                                    async_scheduling=True, max_model_len=WIDTH * BLOCK)
    runner = RecordingRunner(num_blocks, BLOCK)
    run_random_workload(LLMEngine(config, runner=runner), random.Random(seed), "final_only")
    pair, reference = [stager(), stager()], stager()
    pair[0].peer, pair[1].peer = pair[1], pair[0]
    staged_steps, last_step, step_rows = 0, None, StepRows()
    for sent in runner.steps:
        out = step_rows.full(sent)
        seqs = out.sequences
        if not seqs or out.num_tokens != len(seqs) or not all(s.sample for s in seqs):
            continue  # not a decode step: the mixed graphs or the eager path take it
        size, sources = len(seqs), [s.prev_sample_row for s in seqs]
        draw = (np.ones(size, np.float32), np.arange(size) + out.step_id)
        current = pair[staged_steps % 2]
        if sent.continued is not None:
            assert last_step == out.step_id - 1
            blocks = dict(sent.continued.new_blocks)
            current.write_continued(size, Continued(continued_rows(sent.continued),
                                                    lambda row, table: table + (blocks[row],)),
                                    draw)
        elif last_step == out.step_id - 1 and min(sources) >= 0:
            current.write_continued(size, Continued(np.array(sources),
                                                    lambda row, table: seqs[row].block_ids),
                                    draw)
        else:
            current.write(seqs, size, sources, draw)
        reference.write(seqs, size, sources, draw)
        assert staged(current, seqs, size) == staged(reference, seqs, size), out.step_id
        staged_steps, last_step = staged_steps + 1, out.step_id


def test_a_workload_continues_most_decode_steps():
    """The property above is not vacuous: a steady workload stages most decode steps as
    continuations, rows crossing block boundaries among them, and sends some as
    DecodeContinuations with new blocks."""
    config = EngineConfig.from_flat(block_size=BLOCK, num_kv_blocks=64, max_num_seqs=ROWS,
                                    async_scheduling=True, max_model_len=WIDTH * BLOCK)
    runner = RecordingRunner(64, BLOCK)
    run_random_workload(LLMEngine(config, runner=runner), random.Random(7), "final_only")
    assert any(out.continued is not None and out.continued.new_blocks for out in runner.steps)
    step_rows = StepRows()
    steps = [step_rows.full(out) for out in runner.steps]
    decode = [out for out in steps if out.sequences
              and out.num_tokens == len(out.sequences) and all(s.sample for s in out.sequences)]
    placeholders = [out for out in decode if min(s.prev_sample_row for s in out.sequences) >= 0]
    assert len(placeholders) > len(decode) / 2
    assert any(s.start_position % BLOCK == 0 for out in placeholders for s in out.sequences)
