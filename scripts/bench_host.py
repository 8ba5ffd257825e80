"""Host cost of LLMEngine.step() at a decode batch, on the CPU: a no-op model runner samples
instantly, so every millisecond is the engine's own Python. Median ms per phase, for streaming
and final-only outputs (as LLM.generate uses), with and without async scheduling. --offline
times bench_offline's whole workload instead: the host's share of an offline run. --beam W
times the steps of one beam search of width W (`--repeats` searches, a fresh engine each).

    .venv/bin/python scripts/bench_host.py --batch 256
    .venv/bin/python scripts/bench_host.py --offline --num-prompts 1000 --budget 4096
    .venv/bin/python scripts/bench_host.py --beam 4 --steps 60 --repeats 15
"""
from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import numpy as np
from bench_offline import random_prompts
from profile_decode import host_phases

from engine import LLMEngine, SamplingParams
from engine.core.batch import (RunnerOutput, ScheduledSequence, SchedulerOutput, StepRows,
                               TokenLogprobs)
from engine.core.config import EngineConfig
from engine.worker.cuda_graphs import (Continued, DecodeStager, MixedStager,
                                       decode_meta_layout, mixed_capture_sizes,
                                       mixed_meta_layout)
from engine.worker.cuda_graphs.buffers import BufferLayout, token_layout
from engine.worker.inputs import is_decode_step, prepare_host_inputs
from engine.worker.model_runner import PlainDecode, continued_rows, continues_plain_decode
from engine.worker.sampler import Sampler, is_plain_but_masked
from engine.worker.startup import StartupPhases

PHASES = ("schedule", "launch", "update", "outputs", "step_total")


class NoOpRunner:
    """Launch does the real runner's host work for a step (placeholder sources, draw seeds,
    the step's host inputs staged into arrays shaped like the CUDA graphs' pinned buffers,
    two decode mirrors taking turns; a decode step that continues the last one by row index,
    or is sent as a continuation, staged as ModelRunner._launch_plain_decode stages it) and
    samples at once: a token that changes with the step and the row, so detokenization sees
    varied text, and the logprobs of rows that ask for them (a beam's step: its top 2B)."""

    def __init__(self, config: EngineConfig):
        sched, block_size = config.scheduler, config.cache.block_size
        n, width = sched.max_num_seqs, -(-sched.max_model_len // block_size)
        self.num_kv_blocks = config.cache.num_kv_blocks
        self.block_size, self.width = block_size, width
        self.decode_stagers = [DecodeStager(host_views(token_layout(n), np.int64),
                                            host_views(decode_meta_layout(n, width), np.int32),
                                            block_size) for _ in range(2)]
        first, second = self.decode_stagers
        first.peer, second.peer = second, first
        self.mixed_sizes = mixed_capture_sizes(sched.max_num_batched_tokens)
        self.mixed_stager = MixedStager(host_views(token_layout(self.mixed_sizes[-1]), np.int64),
                                        host_views(mixed_meta_layout(n, width), np.int32))
        self.sampler = Sampler(config.model.seed)
        self.startup = StartupPhases()  # nothing to load, compile or size: no phases
        self.rng = np.random.default_rng(0)  # the logprobs of rows that ask for them
        self._steps = 0
        self._decode_steps = 0
        self._plain_decode: PlainDecode | None = None
        self._step_rows = StepRows()

    def launch(self, out: SchedulerOutput) -> SimpleNamespace:
        last, self._plain_decode = self._plain_decode, None
        max_batch = len(self.decode_stagers[0].meta.seq_lens)
        if out.continued is not None and continues_plain_decode(last, out, None, max_batch):
            self._step_rows.skip(out)
            blocks = dict(out.continued.new_blocks)
            ids = out.continued.request_ids
            self._continue(last, out, Continued(continued_rows(out.continued),
                                                lambda row, table: table + (blocks[row],)))
            return self._sampled(ids, [])
        out = self._step_rows.full(out)
        seqs = out.sequences
        sources = [s.prev_sample_row for s in seqs]
        if continues_plain_decode(last, out, sources, max_batch):
            to_sample = seqs
            self._continue(last, out, Continued(np.array(sources, dtype=np.int64),
                                                lambda row, table: seqs[row].block_ids))
        elif is_decode_step(seqs):
            to_sample = seqs
            draw_inputs = self.sampler.draw_inputs(to_sample)
            self._next_decode_stager().write(seqs, len(seqs), sources, draw_inputs)
            if is_plain_but_masked(to_sample):
                self._plain_decode = PlainDecode.of(out.step_id, to_sample, draw_inputs)
        else:
            to_sample = [s for s in seqs if s.sample]
            draw_inputs = self.sampler.draw_inputs(to_sample)
            host = prepare_host_inputs(seqs, self.block_size, self.width)
            size = next(s for s in self.mixed_sizes if s >= len(host.token_ids))
            self.mixed_stager.write(host, sources, draw_inputs, size,
                                    min(size, len(self.decode_stagers[0].meta.seq_lens)))
        return self._sampled([s.request_id for s in to_sample], to_sample)

    def _continue(self, last: PlainDecode, out: SchedulerOutput, continued: Continued) -> None:
        plain = last.continued(out.step_id, continued.src)
        draw_inputs = self.sampler.continued_draw_inputs(plain.temperature, plain.seeded,
                                                         plain.seeds, plain.num_outputs)
        self._next_decode_stager().write_continued(len(continued.src), continued, draw_inputs)
        self._plain_decode = plain

    def _sampled(self, ids: list[str], to_sample: list[ScheduledSequence]) -> SimpleNamespace:
        """The step's tokens (and logprobs of `to_sample`'s rows that ask: none if empty)."""
        self._steps += 1
        tokens = [(self._steps * 7919 + row) % 50000 for row in range(len(ids))]
        logprobs = self._logprobs(to_sample, tokens) if to_sample else [None] * len(ids)
        output = RunnerOutput(ids, tokens, logprobs)
        return SimpleNamespace(wait=lambda: output)  # a pending step, nothing to wait for

    def _logprobs(self, to_sample: list[ScheduledSequence],
                  tokens: list[int]) -> list[TokenLogprobs | None]:
        """Each row asking for k logprobs gets k distinct top tokens, its sampled token first
        (a greedy row's argmax), with random descending logprobs (so beams fork), as Python
        lists like SamplerOutput.to_lists'; None for the others."""
        rows = [row for row, s in enumerate(to_sample) if s.params.logprobs is not None]
        logprobs: list[TokenLogprobs | None] = [None] * len(tokens)
        if not rows:
            return logprobs
        num_top = max(1, *(to_sample[row].params.logprobs for row in rows))
        gaps = self.rng.exponential(1.0, (len(rows), num_top))
        top_lps = (-np.cumsum(gaps, axis=1)).tolist()
        for row, lps in zip(rows, top_lps):
            k = to_sample[row].params.logprobs
            top_ids = [(tokens[row] + 997 * j) % 50000 for j in range(k)]
            logprobs[row] = TokenLogprobs(lps[0], top_ids, lps[:k])
        return logprobs

    def _next_decode_stager(self) -> DecodeStager:
        """The mirror whose turn it is: the other one staged the last decode step."""
        self._decode_steps += 1
        return self.decode_stagers[self._decode_steps % 2]


def host_views(layout: BufferLayout, dtype: type) -> SimpleNamespace:
    """A graph buffer's named views over zeroed host memory (unpinned: nothing is copied)."""
    return layout.views(np.zeros(layout.size, dtype))


def measure(batch: int, steps: int, output_kind: str, async_scheduling: bool) -> dict:
    config = EngineConfig.from_flat(max_num_seqs=batch, async_scheduling=async_scheduling,
                                    num_kv_blocks=batch * (1024 // 16), block_size=16)
    engine = LLMEngine(config, runner=NoOpRunner(config))
    params = SamplingParams(temperature=1.0, ignore_eos=True, output_kind=output_kind)
    return host_phases(engine, batch, params, steps)


def measure_beam(width: int, steps: int) -> dict:
    """One beam search of `width` beams (ignore_eos, 128-token prompt) over `steps` steps,
    as profile_decode --beam times it on the GPU."""
    config = EngineConfig.from_flat(max_num_seqs=width, num_kv_blocks=width * (1024 // 16),
                                    block_size=16)
    engine = LLMEngine(config, runner=NoOpRunner(config))
    return host_phases(engine, 1, SamplingParams(temperature=0.0, ignore_eos=True), steps,
                       beam_width=width)


def print_beam(width: int, steps: int, repeats: int) -> None:
    """measure_beam's phases for `repeats` searches, a fresh engine each, and their medians."""
    print(f"beam {width}, median ms of {steps} steps of one search (async)")
    print(f"{'search':<18}" + "".join(f"{p:>11}" for p in PHASES))
    runs = [measure_beam(width, steps) for _ in range(repeats)]
    for i, result in enumerate(runs):
        print(f"{i:<18}" + "".join(f"{result[p]:>11.4f}" for p in PHASES), flush=True)
    print(f"{'median':<18}" + "".join(f"{statistics.median(r[p] for r in runs):>11.4f}"
                                      for p in PHASES))


def offline_host(batch: int, budget: int, num_prompts: int, input_len: int,
                 output_len: int) -> dict:
    """bench_offline's workload (random prompts, ignore_eos, final-only outputs) to the end."""
    config = EngineConfig.from_flat(max_num_seqs=batch, max_num_batched_tokens=budget,
                                    num_kv_blocks=batch * (1024 // 16), block_size=16)
    engine = LLMEngine(config, runner=NoOpRunner(config))
    params = SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=True,
                            output_kind="final_only")
    for i, prompt in enumerate(random_prompts(num_prompts, input_len, 0, seed=0)):
        engine.add_request(str(i), prompt, params)
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return {"seconds": time.perf_counter() - start, "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--offline", action="store_true")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--budget", type=int, default=4096, help="max_num_batched_tokens")
    parser.add_argument("--beam", type=int, default=0, metavar="W",
                        help="time the steps of one beam search of width W instead")
    parser.add_argument("--repeats", type=int, default=5, help="--beam: searches timed")
    args = parser.parse_args()
    if args.beam:
        print_beam(args.beam, args.steps, args.repeats)
        return
    if args.offline:
        result = offline_host(args.batch, args.budget, args.num_prompts, args.input_len,
                              args.output_len)
        print(f"{args.num_prompts} x ({args.input_len} in, {args.output_len} out), B"
              f"{args.batch}, budget {args.budget}: {result['seconds']:.3f} s of host work in "
              f"{result['steps']} steps")
        return
    print(f"B{args.batch}, median ms of {args.steps} decode steps")
    print(f"{'mode':<18}" + "".join(f"{p:>11}" for p in PHASES))
    for async_scheduling in (True, False):
        for output_kind in ("stream", "final_only"):
            result = measure(args.batch, args.steps, output_kind, async_scheduling)
            mode = f"{'async' if async_scheduling else 'sync'} {output_kind}"
            print(f"{mode:<18}" + "".join(f"{result[p]:>11.3f}" for p in PHASES), flush=True)


if __name__ == "__main__":
    main()
