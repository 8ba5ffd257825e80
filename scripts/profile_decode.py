"""Where a decode step's time goes: graph replay on the GPU versus each host phase of
LLMEngine.step(), plus the number of kernels in the decode graph. --cprofile N adds the N
functions with the most own time over the host phases' steps at the largest batch. --beam W
times the steps of one beam search of width W instead (`batch` is then unused).

    python scripts/profile_decode.py --model gpt2 --batch 1,64,256 --cprofile 25
    python scripts/profile_decode.py --model gpt2 --beam 4 --cprofile 25
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import json
import random
import statistics
import time
from dataclasses import replace

import torch
from bench_utils import checkpoint_for

from engine import LLM, LLMEngine, SamplingParams
from engine.beam_search import BeamSearchParams
from kernels.timing import cuda_ms


def replay_ms(runner, batch: int, repeats: int = 200) -> float:
    """The decode graph's replay of the inputs staged last: call it right after a batch's
    steps, so the rows have their contexts (rows of another batch's padding attend to one
    token, and under-time the attention)."""
    graphs = runner.decode_graphs
    size = next(s for s in graphs.sizes if s >= batch)
    graph = graphs.graphs[size]
    for _ in range(10):
        graph.replay()
    return cuda_ms(graph.replay, repeats)


def host_phases(engine: LLMEngine, batch: int, params: SamplingParams,
                steps: int = 100, profile: cProfile.Profile | None = None,
                beam_width: int = 0) -> dict:
    """Run `steps` decode steps of `batch` requests (128-token prompts, `params` without its
    max_tokens: none ends meanwhile) through LLMEngine.step(), timing the phases it calls
    (wait overlaps the device, and so does everything after launch while the next step runs).
    `beam_width`: one beam search of that width instead of the requests."""
    rng = random.Random(0)
    params = replace(params, max_tokens=steps + 20)
    if beam_width:
        batch = 1
        engine.add_beam_search("p-beam", [rng.randrange(50256) for _ in range(128)],
                               BeamSearchParams(beam_width, steps + 20, ignore_eos=True))
    for i in range(0 if beam_width else batch):
        engine.add_request(f"p{batch}-{i}", [rng.randrange(50256) for _ in range(128)], params)
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()
    timings = {name: [] for name in ("schedule", "launch", "wait", "update", "outputs")}
    timed = [(engine.scheduler, "schedule", "schedule"), (engine.runner, "launch", "launch"),
             (engine.scheduler, "update", "update"), (engine.processor, "process", "outputs")]
    originals = [getattr(obj, name) for obj, name, _ in timed]
    for (obj, name, phase), fn in zip(timed, originals):
        setattr(obj, name, _timed(fn, timings[phase]))
    launch = engine.runner.launch
    engine.runner.launch = lambda out: _TimedWait(launch(out), timings["wait"])
    totals = []
    for _ in range(steps):
        start = time.perf_counter()
        if profile is not None:
            profile.runcall(engine.step)
        else:
            engine.step()
        totals.append((time.perf_counter() - start) * 1e3)
    for (obj, name, _), fn in zip(timed, originals):
        setattr(obj, name, fn)
    for i in range(batch):
        engine.abort("p-beam" if beam_width else f"p{batch}-{i}")
    result = {k: round(statistics.median(v), 4) for k, v in timings.items()}
    return {**result, "step_total": round(statistics.median(totals), 4)}


def _timed(fn, sink: list):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sink.append((time.perf_counter() - start) * 1e3)
    return wrapper


class _TimedWait:
    def __init__(self, pending, sink: list):
        self.pending, self.sink = pending, sink

    def wait(self):
        return _timed(self.pending.wait, self.sink)()


def graph_kernels(runner, batch: int) -> dict:
    """Kernels in the captured decode graph for this batch: its forward run once eagerly
    under the profiler (the same calls the capture recorded, the draw included). Returns their
    count, their summed GPU time (the graph's replay time minus this is launch gaps) and the
    kernels taking the most of it."""
    graphs = runner.decode_graphs
    size = next(s for s in graphs.sizes if s >= batch)
    torch.cuda.synchronize()
    with torch.inference_mode(), torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graphs.forward(size)
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    return {"count": sum(e.count for e in kernels),
            "busy_ms": round(sum(e.self_device_time_total for e in kernels) / 1e3, 4),
            "top_us": {f"{e.key[:60]} x{e.count}": round(e.self_device_time_total, 1)
                       for e in kernels[:10]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--batch", default="1,64")
    parser.add_argument("--output-kind", default="stream", help="stream, delta or final_only")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N")
    parser.add_argument("--beam", type=int, default=0, metavar="W")
    args = parser.parse_args()
    checkpoint = checkpoint_for(args.model)
    batches = [int(b) for b in args.batch.split(",")]
    llm = LLM(model=checkpoint, device="cuda", dtype="float16", max_num_seqs=max(batches))
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, output_kind=args.output_kind)
    result = {}
    if args.beam:
        phases = host_phases(llm.engine, 1, greedy, steps=60, beam_width=args.beam)
        print(args.model, f"beam {args.beam}", json.dumps(phases), flush=True)
    for batch in ([] if args.beam else batches):
        phases = host_phases(llm.engine, batch, greedy)  # first: the graph replays its last step
        result[f"b{batch}"] = {"graph_replay_ms": round(replay_ms(llm.engine.runner, batch), 4),
                               "graph_kernels": graph_kernels(llm.engine.runner, batch),
                               "host_phases_ms": phases}
        print(args.model, batch, json.dumps(result[f"b{batch}"]), flush=True)
    print(args.model, args.output_kind, json.dumps(result), flush=True)
    if args.cprofile:
        profile = cProfile.Profile()
        host_phases(llm.engine, max(batches), greedy, steps=60 if args.beam else 100,
                    profile=profile, beam_width=args.beam)
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.cprofile)
        print(text.getvalue(), flush=True)


if __name__ == "__main__":
    main()
