"""Where a decode step's time goes: graph replay on the GPU versus each host phase of
LLMEngine.step(), plus the number of kernels in the decode graph.

    python scripts/profile_decode.py --model gpt2 --batch 1,64
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
from bench_utils import checkpoint_for

from engine import LLM, SamplingParams


def replay_ms(runner, batch: int, repeats: int = 200) -> float:
    graphs = runner.graphs
    size = next(s for s in graphs.sizes if s >= batch)
    graph = graphs.graphs[size]
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def host_phases(llm: LLM, batch: int, steps: int = 100) -> dict:
    """Run `steps` decode steps phase by phase, as LLMEngine.step() does, timing each
    (outputs_prev overlaps the device)."""
    engine, runner = llm.engine, llm.engine.runner
    rng = random.Random(0)
    for i in range(batch):
        engine.add_request(f"p{batch}-{i}", [rng.randrange(50256) for _ in range(128)],
                           SamplingParams(temperature=0.0, max_tokens=steps + 20,
                                          ignore_eos=True))
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()
    phases = {k: [] for k in ("schedule", "launch", "outputs_prev", "wait", "update",
                              "total")}
    previous, engine._sampled = engine._sampled, []  # take over the engine's pipeline
    for _ in range(steps):
        t0 = time.perf_counter()
        scheduled = engine.scheduler.schedule()
        t1 = time.perf_counter()
        pending = runner.launch(scheduled)
        t2 = time.perf_counter()
        engine._process(previous)
        t3 = time.perf_counter()
        result = pending.wait()
        t4 = time.perf_counter()
        previous = [(r, None) for r in engine.scheduler.update(scheduled, result)]
        t5 = time.perf_counter()
        for name, a, b in [("schedule", t0, t1), ("launch", t1, t2), ("outputs_prev", t2, t3),
                           ("wait", t3, t4), ("update", t4, t5), ("total", t0, t5)]:
            phases[name].append((b - a) * 1e3)
    engine._sampled = previous
    for i in range(batch):
        engine.abort(f"p{batch}-{i}")
    return {k: round(statistics.median(v), 4) for k, v in phases.items()}


def graph_kernel_count(runner, batch: int) -> int:
    """Kernels in the captured decode graph for this batch: its forward run once eagerly
    under the profiler (the same calls the capture recorded, argmax included)."""
    graphs = runner.graphs
    size = next(s for s in graphs.sizes if s >= batch)
    torch.cuda.synchronize()
    with torch.inference_mode(), torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graphs.forward(size).argmax(dim=-1)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--batch", default="1,64")
    args = parser.parse_args()
    checkpoint = checkpoint_for(args.model)
    batches = [int(b) for b in args.batch.split(",")]
    llm = LLM(model=checkpoint, device="cuda", dtype="float16", max_num_seqs=max(batches))
    result = {}
    for batch in batches:
        result[f"b{batch}"] = {"graph_replay_ms": round(replay_ms(llm.engine.runner, batch), 4),
                               "graph_kernels": graph_kernel_count(llm.engine.runner, batch),
                               "host_phases_ms": host_phases(llm, batch)}
        print(args.model, batch, json.dumps(result[f"b{batch}"]), flush=True)
    print(args.model, json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
