"""The scheduler's steady decode step (Scheduler._decode_ahead_rows and, in update,
_apply_ahead) against the general loop it shortcuts: the same random workload through an
EngineCore scheduling ahead, once as it is and once with the shortcut off, must schedule the
same steps row for row and report the same tokens and ends. The workload mixes what stops
the shortcut (length ends, stop tokens, min_tokens, penalties, preemptions, aborts,
arrivals)."""
import gc
import random
import weakref
from dataclasses import astuple

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.messages import CoreRequest
from engine.core.request import SamplingParams
from engine.core.scheduler import Scheduler
from fakes import VOCAB, PipelinedFakeRunner


class RecordingRunner(PipelinedFakeRunner):
    """Keeps every launched step's rows (a continued step's expanded) and preemptions."""

    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size)
        self.steps: list[tuple] = []
        self.continued = 0  # steps sent as a DecodeContinuation

    def launch(self, out):
        self.continued += out.continued is not None
        out = self.step_rows.full(out)
        self.steps.append((out.step_id, [astuple(s) for s in out.sequences],
                           list(out.preempted_ids)))
        return super().launch(out)


def _params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        max_tokens=rng.randint(1, 30), ignore_eos=True,
        stop_token_ids=tuple(rng.sample(range(VOCAB), rng.choice([0, 0, 2]))),
        min_tokens=rng.choice([0, 0, 3]),
        repetition_penalty=1.2 if rng.random() < 0.1 else 1.0,  # it never decodes ahead
        output_kind=rng.choice(["stream", "final_only"]))


def _run(seed: int, num_blocks: int, block_size: int, max_seqs: int, budget: int
         ) -> tuple[list, list, int]:
    """(the launched steps, what each step reported, steps that took the shortcut, steps
    sent as continuations)."""
    rng = random.Random(seed)
    config = EngineConfig.from_flat(max_num_seqs=max_seqs, num_kv_blocks=num_blocks,
                                    block_size=block_size, max_num_batched_tokens=budget,
                                    async_scheduling=True)
    runner = RecordingRunner(num_blocks, block_size)
    core = EngineCore(config, runner)
    shortcuts = _count_shortcuts(core.scheduler)
    reported, live = [], []
    for step in range(2000):
        if step < 60 and rng.random() < 0.3:
            params = _params(rng)
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
            if len(prompt) + params.max_tokens <= num_blocks * block_size:
                core.add(CoreRequest(f"r{step}", prompt, params, 0.0))
                live.append(f"r{step}")
        if live and rng.random() < 0.03:
            core.abort([live.pop(rng.randrange(len(live)))])
        out = core.step()
        new = out.new_tokens
        reported.append(([(o.seq_id, o.new_token_ids, o.finish_reason, o.stop_reason)
                           for o in out.outputs],
                          None if new is None else (new.seq_ids, new.token_ids)))
        if step >= 60 and not core.scheduler.has_unfinished():
            break
    assert not core.scheduler.has_unfinished()
    return runner.steps, reported, shortcuts[0], runner.continued


def _count_shortcuts(scheduler: Scheduler) -> list[int]:
    """[steps whose running rows _decode_ahead_rows scheduled, all or the leading ones], kept
    up to date."""
    count, decode_ahead_rows = [0], scheduler._decode_ahead_rows

    def counted() -> int:
        taken = decode_ahead_rows()
        count[0] += taken > 0
        return taken

    scheduler._decode_ahead_rows = counted
    return count


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), num_blocks=st.integers(16, 64),
       block_size=st.sampled_from([1, 2, 4, 16]), max_seqs=st.integers(1, 8),
       budget=st.integers(4, 64))
def test_steady_decode_steps_match_the_general_loop(seed, num_blocks, block_size, max_seqs,
                                                    budget):
    steps, reported, shortcuts, _ = _run(seed, num_blocks, block_size, max_seqs, budget)
    original = Scheduler._decode_ahead_rows
    Scheduler._decode_ahead_rows = lambda self: 0
    try:
        steps_off, reported_off, shortcuts_off, continued_off = _run(
            seed, num_blocks, block_size, max_seqs, budget)
    finally:
        Scheduler._decode_ahead_rows = original
    assert shortcuts_off == continued_off == 0
    assert steps == steps_off
    assert reported == reported_off


def test_a_steady_decode_batch_takes_the_shortcut_every_step():
    """256 sequences decoding side by side: every token after a sequence's first (its
    prefill's) is sampled by a step whose rows _decode_ahead_rows scheduled, across block
    boundaries too, and every such step after the first is sent as a continuation."""
    batch, max_tokens = 256, 48
    config = EngineConfig.from_flat(max_num_seqs=batch, num_kv_blocks=batch * 8, block_size=16,
                                    max_num_batched_tokens=batch * 16, async_scheduling=True)
    runner = RecordingRunner(batch * 8, 16)
    core = EngineCore(config, runner)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, output_kind="final_only")
    for i in range(batch):
        core.add(CoreRequest(f"s{i}", [i % 90, 1, 2, 3], params, 0.0))
    shortcuts = _count_shortcuts(core.scheduler)
    while core.scheduler.has_unfinished():
        core.step()
    assert shortcuts[0] == max_tokens - 1
    assert runner.continued == max_tokens - 2


def test_rows_ending_by_length_leave_the_run_without_breaking_it():
    """Sequences of staggered lengths (an offline run's tail): each step's rows are the step
    before's less those whose token in flight was their last, so every decode step after
    the first is sent as a continuation, naming the rows it keeps where some ended."""
    batch = 64
    config = EngineConfig.from_flat(max_num_seqs=batch, num_kv_blocks=batch * 8, block_size=4,
                                    max_num_batched_tokens=batch * 16, async_scheduling=True)
    runner = RecordingRunner(batch * 8, 4)
    core = EngineCore(config, runner)
    kept = []
    launch = runner.launch
    runner.launch = lambda out: kept.append(out.continued and out.continued.src) or launch(out)
    for i in range(batch):
        params = SamplingParams(max_tokens=8 + i % 23, ignore_eos=True, output_kind="final_only")
        core.add(CoreRequest(f"s{i}", [i % 90, 1, 2], params, 0.0))
    while core.scheduler.has_unfinished():
        core.step()
    assert runner.continued == len(runner.steps) - 2  # all but the prefill and the first decode
    assert sum(src is not None for src in kept) > 5


def test_a_finished_workload_leaves_no_request_behind():
    """The scheduler keeps the last run's rows to continue them; once every request has
    ended it holds none of them (nor their tokens)."""
    config = EngineConfig.from_flat(max_num_seqs=8, num_kv_blocks=64, block_size=4,
                                    async_scheduling=True)
    core = EngineCore(config, PipelinedFakeRunner(64, 4))
    for i in range(8):
        params = SamplingParams(max_tokens=12, ignore_eos=True, output_kind="final_only")
        core.add(CoreRequest(f"s{i}", [i, 1, 2], params, 0.0))
    requests = []
    while core.scheduler.has_unfinished():
        requests += [weakref.ref(r) for r in core.scheduler.running]
        core.step()
    gc.collect()
    assert requests and not [ref for ref in requests if ref() is not None]
