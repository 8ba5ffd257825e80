"""Host cost of LLMEngine.step() at a decode batch, on the CPU: a no-op model runner samples
instantly, so every millisecond is the engine's own Python. Median ms per phase, for streaming
and final-only outputs (as LLM.generate uses), with and without async scheduling. --offline
times bench_offline's whole workload instead: the host's share of an offline run.

    .venv/bin/python scripts/bench_host.py --batch 256
    .venv/bin/python scripts/bench_host.py --offline --num-prompts 1000 --budget 4096
"""
from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import numpy as np
from bench_offline import random_prompts
from profile_decode import host_phases

from engine import LLMEngine, SamplingParams
from engine.core.batch import RunnerOutput, SchedulerOutput
from engine.core.config import EngineConfig
from engine.worker.cuda_graphs import (DecodeStager, MixedStager, decode_meta_layout,
                                       mixed_capture_sizes, mixed_meta_layout)
from engine.worker.cuda_graphs.buffers import BufferLayout, token_layout
from engine.worker.inputs import is_decode_step, prepare_host_inputs
from engine.worker.model_runner import PlainDecode, continues_plain_decode
from engine.worker.sampler import Sampler, is_plain_but_masked
from engine.worker.startup import StartupPhases

PHASES = ("schedule", "launch", "update", "outputs", "step_total")


class NoOpRunner:
    """Launch does the real runner's host work for a step (placeholder sources, draw seeds,
    the step's host inputs staged into arrays shaped like the CUDA graphs' pinned buffers,
    two decode mirrors taking turns; a decode step that continues the last one by row index
    staged as ModelRunner._launch_plain_decode stages it) and samples at once: a token that
    changes with the step and the row, so detokenization sees varied text."""

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
        self._steps = 0
        self._decode_steps = 0
        self._plain_decode: PlainDecode | None = None

    def launch(self, out: SchedulerOutput) -> SimpleNamespace:
        seqs = out.sequences
        sources = [s.prev_sample_row for s in seqs]
        last, self._plain_decode = self._plain_decode, None
        if continues_plain_decode(last, out, sources, len(self.decode_stagers[0].meta.seq_lens)):
            to_sample, src = seqs, np.array(sources, dtype=np.int64)
            draw_inputs, seeded = self.sampler.continued_draw_inputs(seqs, src, last.temperature,
                                                                      last.seeded)
            self._next_decode_stager().write_continued(seqs, len(seqs), sources, src,
                                                       draw_inputs)
            self._plain_decode = PlainDecode(out.step_id, draw_inputs[0], seeded,
                                             last.constrained[src])
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
        ids = [s.request_id for s in to_sample]
        self._steps += 1
        tokens = [(self._steps * 7919 + row) % 50000 for row in range(len(ids))]
        output = RunnerOutput(ids, tokens, [None] * len(ids))
        return SimpleNamespace(wait=lambda: output)  # a pending step, nothing to wait for

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
    args = parser.parse_args()
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
