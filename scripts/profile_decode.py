"""Where a decode step's time goes: graph replay on the GPU versus each host phase of
LLMEngine.step(), plus the number of kernels in the decode graph. --cprofile N adds the N
functions with the most own time over the host phases' steps at the largest batch. --beam W
times the steps of one beam search of width W instead (`batch` is then unused).
--structured K puts K rows of each batch under a regex that never completes, and adds the
structured-output phases: asking for the mask, waiting for it, the masked draw.

    python scripts/profile_decode.py --model gpt2 --batch 1,64,256 --cprofile 25
    python scripts/profile_decode.py --model gpt2 --beam 4 --cprofile 25
    python scripts/profile_decode.py --model gpt2 --batch 64 --structured 8
    python scripts/profile_decode.py --model gpt2-xl --batch 1 --quantization int8
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
from bench_utils import checkpoint_for, host_probe_us

from engine import LLM, LLMEngine, SamplingParams, StructuredOutputsParams
from engine.beam_search import BeamSearchParams
from kernels.timing import cuda_ms

NEVER_COMPLETE = "[a-z ,.]{2000}"  # a regex no profiled request completes


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
                beam_width: int = 0, structured: int = 0) -> dict:
    """Run `steps` decode steps of `batch` requests (128-token prompts, `params` without its
    max_tokens: none ends meanwhile) through LLMEngine.step(), timing the phases it calls
    (wait overlaps the device, and so does everything after launch while the next step runs).
    `beam_width`: one beam search of that width instead of the requests. `structured`: that
    many of them under NEVER_COMPLETE, timing the grammars' calls and the masked draw too."""
    rng = random.Random(0)
    params = replace(params, max_tokens=steps + 20)
    constrained = replace(params, structured_outputs=StructuredOutputsParams(
        regex=NEVER_COMPLETE))
    if beam_width:
        batch = 1
        engine.add_beam_search("p-beam", [rng.randrange(50256) for _ in range(128)],
                               BeamSearchParams(beam_width, steps + 20, ignore_eos=True))
    if structured:  # every grammar process has imported xgrammar and compiled the regex
        _run_to_end(engine, [(f"warm{batch}-{i}", replace(constrained, max_tokens=1))
                             for i in range(structured)], rng)
    running = engine.scheduler.running
    for first, end, kind in ((0, structured, constrained), (structured, batch, params)):
        for i in range(first, 0 if beam_width else end):
            engine.add_request(f"p{batch}-{i}", [rng.randrange(50256) for _ in range(128)],
                               kind)
        while engine.has_unfinished_requests() and len(running) < structured:
            engine.step()  # the constrained ones first, until their grammar has compiled
    while (any(r.num_computed_tokens < r.num_tokens - 1 for r in running)
           or engine.scheduler.waiting):
        engine.step()
    phases = ("schedule", "launch", "wait", "update", "outputs")
    timed = [(engine.scheduler, "schedule", "schedule"), (engine.runner, "launch", "launch"),
             (engine.scheduler, "update", "update"), (engine.processor, "process", "outputs")]
    if structured:
        phases += ("mask_ask", "mask_wait", "masked_draw")
        grammars = engine.core.grammars
        timed += [(grammars, "request_mask", "mask_ask"), (grammars, "take_mask", "mask_wait"),
                  (engine.runner.sampler, "masked_draw_rows", "masked_draw")]
    timings = {name: [] for name in phases}
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
    result = {k: round(statistics.median(v), 4) if v else None for k, v in timings.items()}
    return {**result, "step_total": round(statistics.median(totals), 4)}


def _run_to_end(engine: LLMEngine, requests: list[tuple[str, SamplingParams]],
                rng: random.Random) -> None:
    """Run `requests` (ids and params, 128-token prompts) until every one has ended: a
    constrained request is admitted only once its grammar compiled, which on CUDA waits for
    the grammar processes' start (seconds), during which the requests already admitted would
    run out of tokens before the timed steps."""
    for request_id, request_params in requests:
        engine.add_request(request_id, [rng.randrange(50256) for _ in range(128)],
                           request_params)
    while engine.has_unfinished_requests():
        engine.step()


def _timed(fn, sink: list):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sink.append((time.perf_counter() - start) * 1e3)
    return wrapper


class _TimedWait:
    """A pending step whose wait is timed; the rest (needs_mask, sample) passes through."""

    def __init__(self, pending, sink: list):
        self.pending, self.sink = pending, sink

    def wait(self):
        return _timed(self.pending.wait, self.sink)()

    def __getattr__(self, name: str):
        return getattr(self.pending, name)


def graph_kernels(runner, batch: int, top: int = 10) -> dict:
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
                       for e in kernels[:top]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--batch", default="1,64")
    parser.add_argument("--output-kind", default="stream", help="stream, delta or final_only")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N")
    parser.add_argument("--beam", type=int, default=0, metavar="W")
    parser.add_argument("--structured", type=int, default=0, metavar="K")
    parser.add_argument("--kernels", type=int, default=10, metavar="N",
                        help="list the decode graph's N kernels taking the most time")
    parser.add_argument("--quantization", choices=("int8", "fp8"),
                        help="8-bit weights for the blocks' linears (default: fp16)")
    args = parser.parse_args()
    checkpoint = checkpoint_for(args.model)
    batches = [int(b) for b in args.batch.split(",")]
    llm = LLM(model=checkpoint, device="cuda", dtype="float16", max_num_seqs=max(batches),
              quantization=args.quantization)
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, output_kind=args.output_kind)
    result = {}
    if args.beam:
        probe = host_probe_us()
        phases = host_phases(llm.engine, 1, greedy, steps=60, beam_width=args.beam)
        print(args.model, f"beam {args.beam}", json.dumps(
            {**phases, "host_probe_us": [probe, host_probe_us()]}), flush=True)
    for batch in ([] if args.beam else batches):
        # first: the graph replays its last step
        probe = host_probe_us()
        phases = host_phases(llm.engine, batch, greedy, structured=min(args.structured, batch))
        result[f"b{batch}"] = {"graph_replay_ms": round(replay_ms(llm.engine.runner, batch), 4),
                               "graph_kernels": graph_kernels(llm.engine.runner, batch,
                                                              args.kernels),
                               "host_phases_ms": phases,
                               "host_probe_us": [probe, host_probe_us()]}
        print(args.model, batch, json.dumps(result[f"b{batch}"]), flush=True)
    print(args.model, args.output_kind, json.dumps(result), flush=True)
    if args.cprofile:
        profile = cProfile.Profile()
        host_phases(llm.engine, max(batches), greedy, steps=60 if args.beam else 100,
                    profile=profile, beam_width=args.beam,
                    structured=min(args.structured, max(batches)))
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.cprofile)
        print(text.getvalue(), flush=True)


if __name__ == "__main__":
    main()
