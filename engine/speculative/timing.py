"""The step times switch.py decides from, measured at startup for each batch size B a step
can hold and k in 1..K: a plain decode step T(B), and a speculative step S(B, k) = verifying
B rows of k + 1 tokens plus the proposal (n-gram host time, or the draft model's k iterations).

Synthetic steps share one block table (blocks 0.., before anything is cached). Wall-clock
seconds as the engine's loop runs them: plain steps pipelined, speculative ones one at a time.
"""
from __future__ import annotations

import statistics
import time

from engine.core.batch import ScheduledSequence, SchedulerOutput
from engine.core.config import SchedulerConfig, SpeculativeConfig
from engine.core.request import SamplingParams
from engine.speculative.ngram import NgramProposer
from engine.speculative.proposer import DraftContext
from engine.speculative.switch import StepTimes

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CONTEXT = 256  # tokens in the cache before the measured positions
GREEDY = SamplingParams(temperature=0.0)


def measure_step_times(runner, spec: SpeculativeConfig, sched: SchedulerConfig,
                       repeats: int = 5) -> StepTimes:
    """`runner`: a built ModelRunner (its `execute`, `launch`, `block_size`,
    `num_kv_blocks`), its speculation in place."""
    k_max = spec.num_speculative_tokens
    sizes = sorted({b for b in BATCH_SIZES + (sched.max_num_seqs,)
                    if b <= sched.max_num_seqs and b * (k_max + 1) <= sched.max_num_batched_tokens})
    room = min(sched.max_model_len, runner.num_kv_blocks * runner.block_size)
    context = min(CONTEXT, room) - 2 * k_max - 1
    plain = tuple(_seconds(runner, _step(b, 0, context, runner.block_size), repeats,
                           pipelined=sched.async_scheduling) for b in sizes)
    speculative = {}
    for k in range(1, k_max + 1):
        propose = proposer_seconds(spec, k, context) if spec.method == "ngram" else 0.0
        speculative[k] = tuple(
            _seconds(runner, _step(b, k, context, runner.block_size), repeats) + b * propose
            for b in sizes)
    return StepTimes(tuple(sizes), plain, speculative)


def _step(batch: int, k: int, context: int, block_size: int) -> SchedulerOutput:
    """batch decoding sequences at position `context`, each with k drafts and blocks for k
    positions past them, as the scheduler gives a speculating request (its lookahead)."""
    blocks = tuple(range(-(-(context + 2 * k + 1) // block_size)))
    seqs = [ScheduledSequence(f"timing-{i}", [0] * (k + 1), context, blocks, True, GREEDY,
                              num_drafts=k) for i in range(batch)]
    return SchedulerOutput(seqs, num_draft_tokens=batch * k)


def _seconds(runner, step: SchedulerOutput, repeats: int, pipelined: bool = False) -> float:
    """The median of `repeats` steps waited for one by one; `pipelined`: the mean of
    `repeats` launched back to back, then waited for."""
    runner.execute(step)  # warm-up
    if pipelined:
        start = time.perf_counter()
        for pending in [runner.launch(step) for _ in range(repeats)]:
            pending.wait()
        return (time.perf_counter() - start) / repeats
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.execute(step)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def proposer_seconds(spec: SpeculativeConfig, k: int, context: int,
                      requests: int = 64) -> float:
    """Host seconds of one n-gram proposal per request, its prompt already indexed."""
    proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    prompt = [i % 97 for i in range(context)]  # repeats: every lookup finds a match
    contexts = [DraftContext(str(i), prompt, [], k) for i in range(requests)]
    for c in contexts:
        proposer.propose(c)  # indexes the prompt, once per request: not timed
    grown = [DraftContext(c.request_id, prompt, [7], k) for c in contexts]
    start = time.perf_counter()
    for c in grown:
        proposer.propose(c)
    return (time.perf_counter() - start) / requests
