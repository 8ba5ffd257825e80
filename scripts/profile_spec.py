"""Where a speculative step's time goes with a draft model: the host phases of
EngineCore.step (schedule, the draft's fill, the target's launch,
the waits, update) against the device's busy and idle time, from a torch.profiler trace of
one stream decoding with every step drafting k (the oracle sets acceptance, as in
bench_spec.py --draft-model).

    python3 scripts/profile_spec.py --model gpt2-xl --draft-model gpt2 --out $OUT

Prints a timeline of a few steps (host phases, and the device's busy segments: kernels
closer than 5 us merged) and writes profile_spec.json: per step, the wall time, the device's
busy time, and each host phase's time (inflated by the profiler's own host cost, so a second
run times the phases with perf_counter alone: "host_phases_ms"), the device's idle time
before the draft and before the verification (CUDA events, a third run: "device_gaps");
and "graphs": each CUDA graph a speculative step replays (the draft's first iteration
and one after it, the target's verification graph, the draft's
follow pass over the same tokens, which a step of verification rows only skips) and the
target's plain decode graph, replayed alone under the profiler: its kernels in order with
their device time.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from bench_utils import checkpoint_for
from spec_bench_engine import Bench, random_tokens

from kernels.timing import cuda_ms

GAP_US = 5.0  # kernels closer than this are one busy segment


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2-xl")
    parser.add_argument("--draft-model", default="gpt2")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--rate", type=float, default=0.7, help="the oracle's acceptance")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--show-steps", type=int, default=3)
    parser.add_argument("--cprofile", action="store_true",
                        help="also run the stream under cProfile: profile_spec_host.txt")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    args.batches, args.ks, args.batch_k = "1", str(args.k), args.k  # what Bench reads
    return args


def annotate(obj, name: str, label: str) -> None:
    """Wrap obj.name in a profiler range called label."""
    fn = getattr(obj, name)

    def wrapped(*a, **kw):
        with torch.profiler.record_function(label):
            return fn(*a, **kw)

    setattr(obj, name, wrapped)


def annotate_waits(runner, label: str) -> None:
    """runner.launch's pending step, its wait() in a range called label."""
    launch = runner.launch

    def launched(out):
        pending = launch(out)
        annotate(pending, "wait", label)
        return pending

    runner.launch = launched


def install_ranges(bench: Bench) -> None:
    core = bench.engine.core
    drafter = core.runner.speculation.drafter
    annotate(core.scheduler, "schedule", "schedule")
    annotate(core.scheduler, "update", "update")
    annotate(drafter, "fill", "fill")
    annotate_waits(core.runner, "target wait")
    annotate(core.runner, "launch", "target launch")
    annotate(core, "step", "step")


def time_host_phases(bench: Bench, run) -> dict:
    """Median ms per step of each host phase, and of the whole step, timed with perf_counter
    (phases nest: fill holds the draft's launches and waits)."""
    core = bench.engine.core
    targets = [(core.scheduler, "schedule"), (core.scheduler, "update"), (core, "step"),
               (core.runner.speculation.drafter, "fill"), (core.runner, "launch")]
    times: dict[str, list[float]] = defaultdict(list)
    originals = [getattr(obj, name) for obj, name in targets]
    for (obj, name), fn in zip(targets, originals):
        setattr(obj, name, _timed(fn, times[f"{type(obj).__name__}.{name}"]))
    run()
    for (obj, name), fn in zip(targets, originals):
        setattr(obj, name, fn)
    return {name: round(statistics.median(t) * 1e3, 4) for name, t in times.items()}


class _Marked:
    """A graph whose replay first records a CUDA event (it completes when the device reaches
    the graph: when the work before it is done and the host has launched it)."""

    def __init__(self, graph, timeline: list, kind: str):
        self.graph, self.timeline, self.kind = graph, timeline, kind

    def replay(self) -> None:
        _mark(self.timeline, self.kind)
        self.graph.replay()


def _marking_after(fn, timeline: list, kind: str):
    def marking(*a, **kw):
        result = fn(*a, **kw)
        _mark(timeline, kind)
        return result
    return marking


def _marking_before(fn, timeline: list, kind: str):
    def marking(*a, **kw):
        _mark(timeline, kind)
        return fn(*a, **kw)
    return marking


def _mark(timeline: list, kind: str) -> None:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    timeline.append((kind, event))


def device_gaps(bench: Bench, run) -> dict:
    """Median device idle a step, in us, from CUDA events recorded as the host launches:
    "before_draft", from the end of the last step's work to the draft's first iteration
    (the host's wait, update, schedule and staging; ~0 where the draft is queued ahead,
    right behind the verification), and "before_verify", from the draft's last iteration
    to the verification graph (the host late with its launch)."""
    runner = bench.engine.core.runner
    drafter, mixed = runner.speculation.drafter, runner.mixed_graphs
    chain, timeline = drafter.chain, []
    saved = dict(chain.graphs)
    verify_graphs = dict(mixed.graphs)
    methods = [(chain, "run"), (chain, "run_ahead"), (drafter, "draft_ahead"),
               (runner, "launch")]
    originals = [getattr(obj, name) for obj, name in methods]
    for size, graphs in saved.items():
        chain.graphs[size] = [_Marked(graphs[0], timeline, "draft"), *graphs[1:]]
    for size, graph in verify_graphs.items():
        mixed.graphs[size] = _Marked(graph, timeline, "verify")
    # the step's work is queued when the draft is about to be queued ahead, or at the end
    # of the launch; a chain run ends the draft
    chain.run, chain.run_ahead = (_marking_after(fn, timeline, "draft end")
                                  for fn in originals[:2])
    drafter.draft_ahead = _marking_before(originals[2], timeline, "step end")
    runner.launch = _marking_after(originals[3], timeline, "step end")
    run()
    torch.cuda.synchronize()
    chain.graphs.update(saved)
    mixed.graphs.update(verify_graphs)
    for (obj, name), fn in zip(methods, originals):
        setattr(obj, name, fn)
    gaps: dict[str, list[float]] = {"before_draft": [], "before_verify": []}
    after = {"draft": "step end", "verify": "draft end"}
    last: dict[str, torch.cuda.Event] = {}
    for kind, event in timeline:
        if kind in after and after[kind] in last:
            gaps[f"before_{kind}"].append(last.pop(after[kind]).elapsed_time(event) * 1e3)
        last[kind] = event
    return {f"{name}_us": round(statistics.median(values), 1) for name, values in gaps.items()
            if values} | {"steps": len(gaps["before_verify"])}


def _timed(fn, into: list[float]):
    def timed(*a, **kw):
        start = time.perf_counter()
        result = fn(*a, **kw)
        into.append(time.perf_counter() - start)
        return result
    return timed


def host_profile(run, path: Path) -> None:
    """cProfile of run(): the functions with the most time of their own, and by cumulative
    time."""
    profiler = cProfile.Profile()
    profiler.enable()
    run()
    profiler.disable()
    text = io.StringIO()
    for order in ("tottime", "cumulative"):
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(45)
    path.write_text(text.getvalue())


def graph_kernels(graph: torch.cuda.CUDAGraph, replays: int = 5) -> dict:
    """The graph's kernels in launch order with their median device us over a few replays,
    their total, and the host's time to launch the graph (replay()) with the device idle and
    right after launching it once more (a launch of a graph still running may wait)."""
    launch_us, relaunch_us = [], []
    for _ in range(replays):
        torch.cuda.synchronize()
        start = time.perf_counter()
        graph.replay()
        launch_us.append((time.perf_counter() - start) * 1e6)
        start = time.perf_counter()
        graph.replay()
        relaunch_us.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                     key=lambda e: e.time_range.start)
    per_replay = len(kernels) // replays
    rows = [(kernels[i].name, statistics.median(kernels[i + r * per_replay].time_range
                                                  .elapsed_us() for r in range(replays)))
            for i in range(per_replay)]
    # kernel times under programmatic dependent launch include waiting for the one before:
    # the replay's own device time is the figure to add up
    return {"kernels": len(rows), "kernel_sum_us": round(sum(t for _, t in rows), 1),
            "device_us": round(cuda_ms(graph.replay, 20) * 1e3, 1),
            "launch_host_us": round(statistics.median(launch_us), 1),
            "relaunch_host_us": round(statistics.median(relaunch_us), 1),
            "sequence": [[name[:60], round(t, 2)] for name, t in rows]}


def profile_graphs(plain: Bench, bench: Bench, k: int) -> dict:
    """Each graph as the last step of its size left its buffers."""
    target = bench.engine.core.runner
    drafter = bench.engine.core.runner.speculation.drafter
    verify_size = next(s for s in target.mixed_graphs.sizes if s >= k + 1)
    return {"target_decode_1": graph_kernels(plain.engine.core.runner.decode_graphs.graphs[1]),
            f"target_verify_{verify_size}": graph_kernels(target.mixed_graphs.graphs[verify_size]),
            f"draft_follow_{verify_size}":
                graph_kernels(target.mixed_graphs.follow_graphs[verify_size]),
            "draft_chain_1_first": graph_kernels(drafter.chain.graphs[1][0]),
            "draft_chain_1_next": graph_kernels(drafter.chain.graphs[1][1])}


def busy_segments(kernels: list[tuple[float, float]]) -> list[list[float]]:
    """[start, end, count] of device activity, kernels closer than GAP_US merged."""
    segments: list[list[float]] = []
    for start, end in sorted(kernels):
        if segments and start - segments[-1][1] < GAP_US:
            segments[-1][1] = max(segments[-1][1], end)
            segments[-1][2] += 1
        else:
            segments.append([start, end, 1])
    return segments


def analyse(trace: dict, show_steps: int) -> dict:
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    ranges = [e for e in events if e.get("cat") == "user_annotation"]
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in events
               if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    steps = sorted((e for e in ranges if e["name"] == "step"), key=lambda e: e["ts"])
    rows = []
    for n, step in enumerate(steps):
        lo, hi = step["ts"], step["ts"] + step["dur"]
        inside = [(max(s, lo), min(e, hi)) for s, e in kernels if e > lo and s < hi]
        segments = busy_segments(inside)
        phases = defaultdict(float)
        for e in ranges:
            if e["name"] != "step" and lo <= e["ts"] < hi:
                phases[e["name"]] += e["dur"]
        rows.append({"wall_us": step["dur"], "device_busy_us": sum(e - s for s, e, _ in
                                                                    segments),
                     "kernels": len(inside), **{f"{k}_us": v for k, v in phases.items()}})
        if n < show_steps:
            print_timeline(step, ranges, segments)
    summary = {key: statistics.median(r.get(key, 0.0) for r in rows)
               for key in sorted({k for r in rows for k in r})}
    return {"steps": len(rows), "median": summary, "per_step": rows}


def print_timeline(step: dict, ranges: list[dict], segments: list[list[float]]) -> None:
    lo, hi = step["ts"], step["ts"] + step["dur"]
    lines = [(e["ts"] - lo, f"host   {e['name']:<14} {e['dur']:8.1f} us") for e in ranges
             if e["name"] != "step" and lo <= e["ts"] < hi]
    lines += [(s - lo, f"device busy          {e - s:8.1f} us ({n} kernels)")
              for s, e, n in segments]
    print(f"--- step: {step['dur']:.1f} us")
    for at, text in sorted(lines):
        print(f"  {at:8.1f}  {text}")


def main() -> None:
    args = parse_args()
    rng = random.Random(0)
    prompt = random_tokens(rng, args.prompt_len)
    blocks = 8 * -(-(args.prompt_len + args.output_len + args.k) // 16)
    plain = Bench(args, None, num_kv_blocks=blocks)
    reference = plain.run([prompt])[0][0].token_ids
    bench = Bench(args, {"model": checkpoint_for(args.draft_model)}, num_kv_blocks=blocks)
    bench.configure(args.k)
    bench.run([prompt], [reference], args.rate)  # warm-up
    install_ranges(bench)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        bench.run([prompt], [reference], args.rate)
    args.out.mkdir(parents=True, exist_ok=True)
    trace_path = args.out / "profile_spec_trace.json"
    prof.export_chrome_trace(str(trace_path))
    result = analyse(json.loads(trace_path.read_text()), args.show_steps)
    result["host_phases_ms"] = time_host_phases(
        bench, lambda: bench.run([prompt], [reference], args.rate))
    print(json.dumps(result["host_phases_ms"], indent=1))
    if args.device == "cuda":
        result["device_gaps"] = device_gaps(
            bench, lambda: bench.run([prompt], [reference], args.rate))
        print(json.dumps(result["device_gaps"]))
    if args.cprofile:
        host_profile(lambda: bench.run([prompt], [reference], args.rate),
                     args.out / "profile_spec_host.txt")
    if args.device == "cuda":
        result["graphs"] = profile_graphs(plain, bench, args.k)
        print(json.dumps({name: [g["kernels"], g["device_us"], g["launch_host_us"],
                                 g["relaunch_host_us"]]
                          for name, g in result["graphs"].items()}))
    result["args"] = {k: str(v) for k, v in vars(args).items()}
    (args.out / "profile_spec.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result["median"], indent=1))


if __name__ == "__main__":
    main()
