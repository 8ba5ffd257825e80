"""Where an offline run's time goes, by step kind: bench_offline's workload (random prompts,
temperature 1, ignore_eos) through LLMEngine.step(), with each step's host phases (schedule,
launch, update) and, on CUDA, its device time: events recorded before and after its launch span
its work on the stream (a device idle between steps does not count; one waiting inside a step
for the host to launch the rest of it, an eager step's, does). Decode steps (one new token a
row) and mixed steps (prompt chunks beside decodes) apart, against the run's wall time: the
device's busy share says whether the host or the device sets the pace. --kernels N adds the N
kernels (CPU: ops) with the most device time over the timed run, by torch.profiler, which sees
the kernels inside CUDA graphs too; the profiler slows the host, so with it the wall time and
the busy share are not the run's own.

    python scripts/profile_offline.py --model gpt2 --num-prompts 1000 [--kernels 15]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections import defaultdict

import torch
from bench_offline import random_prompts
from bench_utils import checkpoint_for

from engine import LLM, SamplingParams
from engine.core.batch import SchedulerOutput

HOST_PHASES = ("schedule", "launch", "update")


def step_kind(out: SchedulerOutput) -> str:
    """A continued step (SchedulerOutput.continued) is a decode step too."""
    one_token_rows = out.continued is not None or out.num_tokens == len(out.sequences)
    return "decode" if one_token_rows else "mixed"


class StepTimes:
    """Per step kind: steps, tokens, host milliseconds per phase and device milliseconds."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.host: dict[tuple[str, str], float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.tokens: dict[str, int] = defaultdict(int)
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    def wrap(self, engine) -> None:
        """Time the engine's scheduler and runner calls, by the kind of step each one serves."""
        scheduler, runner = engine.scheduler, engine.runner
        schedule, launch, update = scheduler.schedule, runner.launch, scheduler.update

        def timed_schedule():
            start = time.perf_counter()
            out = schedule()
            if not out.is_empty:
                self._add(step_kind(out), "schedule", start)
            return out

        def timed_launch(out):
            kind = step_kind(out)
            if self.cuda:  # the events' own host time stays out of the launch's
                before, after = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                before.record()
            start = time.perf_counter()
            pending = launch(out)
            self._add(kind, "launch", start)
            if self.cuda:
                after.record()
                self._events.append((kind, before, after))
            self.counts[kind] += 1
            self.tokens[kind] += out.num_tokens
            return pending

        def timed_update(out, output):
            start = time.perf_counter()
            changed = update(out, output)
            self._add(step_kind(out), "update", start)
            return changed

        scheduler.schedule, runner.launch, scheduler.update = (timed_schedule, timed_launch,
                                                               timed_update)

    def _add(self, kind: str, phase: str, start: float) -> None:
        self.host[kind, phase] += (time.perf_counter() - start) * 1e3

    def report(self, wall_s: float) -> dict:
        device: dict[str, float] = defaultdict(float)
        if self.cuda:
            torch.cuda.synchronize()
            for kind, before, after in self._events:
                device[kind] += before.elapsed_time(after)
        kinds = {kind: {"steps": self.counts[kind], "tokens": self.tokens[kind],
                        **{f"{phase}_ms": round(self.host[kind, phase], 1)
                           for phase in HOST_PHASES},
                        "device_ms": round(device[kind], 1) if self.cuda else None}
                 for kind in sorted(self.counts)}
        busy = sum(device.values()) / (wall_s * 1e3) if self.cuda else None
        return {"wall_s": round(wall_s, 3), "device_busy": busy and round(busy, 3),
                "kinds": kinds}


def top_kernels(prof, cuda: bool, n: int) -> list[dict]:
    """The n kernels (ops on CPU) with the most device time, with their calls and share."""
    def own_time(e) -> float:
        return e.self_device_time_total if cuda else e.self_cpu_time_total

    events = [e for e in prof.key_averages() if own_time(e) > 0]
    total = sum(own_time(e) for e in events)
    events.sort(key=own_time, reverse=True)
    return [{"name": e.key[:80], "calls": e.count, "ms": round(own_time(e) / 1e3, 1),
             "share": round(own_time(e) / total, 3)} for e in events[:n]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--kernels", type=int, default=0, metavar="N",
                        help="also list the N kernels with the most device time")
    args = parser.parse_args()
    llm = LLM(model=checkpoint_for(args.model), device=args.device,
              max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens)
    engine = llm.engine
    params = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True,
                            output_kind="final_only")
    # warm-up over other prompts (the same ones would hit the prefix cache in the timed run)
    for i, prompt in enumerate(random_prompts(args.max_num_seqs, args.input_len, 0, seed=1)):
        engine.add_request(f"warm{i}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    times = StepTimes(args.device == "cuda")
    times.wrap(engine)
    for i, prompt in enumerate(random_prompts(args.num_prompts, args.input_len, 0, seed=0)):
        engine.add_request(str(i), prompt, params)
    if times.cuda:
        torch.cuda.synchronize()
    activity = (torch.profiler.ProfilerActivity.CUDA if times.cuda
                else torch.profiler.ProfilerActivity.CPU)
    profiler = (torch.profiler.profile(activities=[activity]) if args.kernels
                else contextlib.nullcontext())
    start = time.perf_counter()
    with profiler:
        while engine.has_unfinished_requests():
            engine.step()
        if times.cuda:
            torch.cuda.synchronize()
    report = times.report(time.perf_counter() - start)
    if args.kernels:
        report["kernels"] = top_kernels(profiler, times.cuda, args.kernels)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
