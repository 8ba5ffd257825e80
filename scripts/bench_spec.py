"""Speculative decoding's speed against the same engine without it, in one run (issue 15).

    python3 scripts/bench_spec.py --model gpt2-xl --out $OUT          # GPU node
    python3 scripts/bench_spec.py --replot $OUT/spec.json             # the PNGs again

Random weights make real acceptance meaningless, so the oracle proposer replays the target's
own greedy output with each draft corrupted with probability 1 - a:
  * one stream: speedup against a for each k (every step drafting k, and as served: with
    the switch-off, which stops drafting where it would lose), beside the analytic expectation
    E / (k c + 1), E = (1 - a^(k+1)) / (1 - a), c the proposer's cost per draft over one
    decode step, and the refined E / (k c + V/T) with V/T the measured verification cost;
  * batch sizes at a = 0.7, k = 4: throughput with the switch-off on and off;
  * the real n-gram proposer on prompts that restate a passage: acceptance and speedup;
  * one plain stream with and without scheduling ahead: what a speculating step gives up by
    being applied before the next is scheduled.
Speculation off is the same engine with its draft length set to 0. Writes spec.json and, where
matplotlib is installed, spec_rates.png and spec_batches.png under --out.

With --draft-model (an arch name, random weights, or a path) it measures the draft_model
method instead: one stream, the draft drafting at each k against an engine without a draft
(the draft's engine pays its forward on every step, even at k = 0), and the acceptance; then
at each of --rates, with the draft's tokens swapped for the oracle's after the draft has run
(its cost real, its acceptance set). A draft of the target's own arch (same random weights)
accepts every greedy draft:

    python3 scripts/bench_spec.py --model gpt2-xl --draft-model gpt2 --out $OUT
    python3 scripts/bench_spec.py --model gpt2-xl --draft-model gpt2-xl --out $OUT/copy
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from bench_utils import checkpoint_for, device_info, write_result
from plot_spec import replot
from spec_bench_engine import (Bench, acceptance, decode_seconds_per_token,
                               first_divergence, largest_k, numbers, random_tokens)

from engine.speculative.ngram import NgramProposer
from engine.speculative.switch import expected_tokens
from engine.speculative.timing import proposer_seconds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-xl", help="arch name (random weights) or path")
    parser.add_argument("--out", default=".", help="directory for spec.json and the PNGs")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=("float16", "bfloat16", "float32"),
                        help="default: float16 on cuda, float32 on cpu; float32 on a GPU tells "
                        "fp16 rounding from a bug when a run records diverged_at")
    parser.add_argument("--rates", default="0,0.5,0.7,0.9,1.0")
    parser.add_argument("--ks", default="2,4,6")
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--batch-rate", type=float, default=0.7)
    parser.add_argument("--batch-k", type=int, default=4)
    parser.add_argument("--batch-repeats", type=int, default=3,
                        help="rounds of plain, forced and switched runs per batch size")
    parser.add_argument("--stream-repeats", type=int, default=3,
                        help="rounds of plain and speculative runs per single-stream point")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--draft-model", help="measure this draft model (arch or path) only")
    parser.add_argument("--replot", metavar="JSON", help="only redraw the PNGs of a result")
    return parser.parse_args(argv)


def single_stream(bench: Bench, prompt: list[int], c: float, verify_ratio: dict) -> list:
    """Per k and a, --stream-repeats rounds of a plain run, a forced one (every step
    drafts) and, where the cost model was measured, a switched one (as served); the speedups
    are the medians of the rounds' (lists beside them), the acceptance that of every forced
    run, diverged_at the first divergence of any run."""
    args = bench.args
    bench.configure(0)
    outputs, _ = bench.run([prompt])
    reference = outputs[0].token_ids
    modes = {"speedup": False, **({"speedup_switch_on": True} if bench.step_times else {})}
    rows = []
    for k in numbers(args.ks, int):
        for a in numbers(args.rates):
            ratios, counted, diverged = {name: [] for name in modes}, Counted(), []
            for round_ in range(args.stream_repeats):
                bench.configure(0)
                plain = decode_seconds_per_token(bench.run([prompt])[0][0])
                for name, adaptive in modes.items():
                    bench.configure(k, adaptive=adaptive)
                    outputs = counted.run(bench, not adaptive, [prompt], [reference], a, round_)
                    ratios[name].append(plain / decode_seconds_per_token(outputs[0]))
                    diverged.append(first_divergence(outputs[0].token_ids, reference))
            expected = expected_tokens(a, k)
            rows.append({"k": k, "a": a, **medians(ratios), "expected": expected / (k * c + 1),
                         "expected_refined": expected / (k * c + verify_ratio.get(k, 1.0)),
                         "diverged_at": next((d for d in diverged if d is not None), None),
                         **counted.acceptance()})
            print(json.dumps(rows[-1]), flush=True)
    return rows


class Counted:
    """The speculation counters summed over the runs a point counts (its forced runs, each
    round's oracle pattern its own: round r draws from seed r in every process)."""

    def __init__(self) -> None:
        self.totals: dict[str, int] = {}
        self.a_rounds: list[float] = []  # each counted run's a

    def run(self, bench: Bench, counts: bool, prompts: list, references: list | None,
            rate: float, seed: int) -> list:
        """bench.run's outputs; its counters are summed if `counts`."""
        before = bench.counters()
        outputs, _ = bench.run(prompts, references, rate, seed)
        if counts:
            after = bench.counters()
            for name, value in after.items():
                self.totals[name] = self.totals.get(name, 0) + value - before[name]
            self.a_rounds.append(acceptance(before, after)["a_measured"])
        return outputs

    def acceptance(self) -> dict:
        return {**acceptance(dict.fromkeys(self.totals, 0), self.totals),
                "a_rounds": self.a_rounds}


def medians(ratios: dict[str, list[float]]) -> dict:
    """Each name's median, and its rounds under the name + "s"."""
    return {**{name: statistics.median(r) for name, r in ratios.items()},
            **{f"{name}s": r for name, r in ratios.items()}}


def batches(bench: Bench, rng: random.Random) -> list:
    """Throughput against no speculation per batch size: plain, forced (every step drafts)
    and switched (the switch-off decides) runs in turn, --batch-repeats times; the speedups
    are the medians of each round's ratios (one run each swung 0.75-1.10x at batch 128)."""
    args, rows = bench.args, []
    modes = [("switch_off", False)] + ([("switch_on", True)] if bench.step_times else [])
    for batch in numbers(args.batches, int):
        prompts = [random_tokens(rng, args.prompt_len) for _ in range(batch)]
        bench.configure(0)
        outputs, _ = bench.run(prompts)
        references = [o.token_ids for o in outputs]
        tokens = sum(len(r) for r in references)
        plain_seconds, ratios = [], {name: [] for name, _ in modes}
        for _ in range(args.batch_repeats):
            bench.configure(0)
            plain_seconds.append(bench.run(prompts)[1])
            for name, adaptive in modes:
                bench.configure(args.batch_k, adaptive=adaptive)
                ratios[name].append(plain_seconds[-1]
                                    / bench.run(prompts, references, args.batch_rate)[1])
        row = {"batch": batch, "plain_tok_s": tokens / statistics.median(plain_seconds),
               **{f"speedup_{name}": statistics.median(r) for name, r in ratios.items()},
               **{f"speedups_{name}": r for name, r in ratios.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def ngram_workload(bench: Bench, rng: random.Random) -> dict:
    """Prompts restating a passage three times, then its start (the lookup finds it), one
    stream at a time."""
    args = bench.args
    passage_len = max(args.prompt_len // 4, 8)
    prompts = []
    for _ in range(4):
        passage = random_tokens(rng, passage_len)
        prompts.append(passage * 3 + passage[:passage_len // 2])
    bench.configure(0)
    plain = [bench.run([p])[0][0] for p in prompts]  # one stream at a time
    k, cfg = args.batch_k, bench.llm.engine.config.speculative
    bench.configure(k, proposer=NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max))
    before = bench.counters()
    spec = [bench.run([p])[0][0] for p in prompts]
    after = bench.counters()
    speedups = [decode_seconds_per_token(p) / decode_seconds_per_token(s)
                for p, s in zip(plain, spec)]
    return {"k": k, "lookup": [cfg.prompt_lookup_min, cfg.prompt_lookup_max],
            "diverged_at": [first_divergence(s.token_ids, p.token_ids)
                            for s, p in zip(spec, plain)],
            "speedup_mean": sum(speedups) / len(speedups), **acceptance(before, after)}


def pipelining(bench: Bench, prompt: list[int]) -> dict:
    """One plain stream with and without scheduling one step ahead: what a speculating step,
    applied before the next is scheduled, gives up (its host work is not overlapped)."""
    core, result = bench.engine.core, {}
    bench.configure(0)
    pipelined = core.config
    for mode in (True, False):
        while core.has_unfinished():  # a step still in flight belongs to the old mode
            core.step()
        core.config = replace(pipelined, scheduler=replace(pipelined.scheduler,
                                                           async_scheduling=mode))
        outputs, _ = bench.run([prompt])
        result["async_ms_per_token" if mode else "sync_ms_per_token"] = (
            decode_seconds_per_token(outputs[0]) * 1e3)
    core.config = pipelined
    return result


def draft_model_stream(args: argparse.Namespace, prompt: list[int]) -> dict:
    """The draft model at each k (switch-off out) against an engine without speculation, one
    stream, in --stream-repeats rounds of a plain and a speculative run (medians, as
    single_stream's); both engines' pools hold a few streams, so they fit side by side. The
    expectation
    is E(a, k) at the measured a over S(1, k) / plain: the speculative step (drafting and
    verification, measured at startup on CUDA) over the plain engine's time per token."""
    blocks = 8 * -(-(args.prompt_len + args.output_len + largest_k(args)) // 16)
    plain = Bench(args, None, num_kv_blocks=blocks)
    bench = Bench(args, {"model": checkpoint_for(args.draft_model)}, num_kv_blocks=blocks)
    plain.run([prompt])  # warm-up
    bench.configure(0)
    bench.run([prompt])
    outputs, _ = plain.run([prompt])
    reference, plain_times = outputs[0].token_ids, []
    times = bench.step_times  # None off CUDA
    rows = []
    for k in numbers(args.ks, int):
        for a in [None, *numbers(args.rates)]:  # None: the draft's own tokens
            ratios, counted, diverged = {"speedup": []}, Counted(), []
            for round_ in range(args.stream_repeats):  # rounds of plain, then speculative
                plain_times.append(decode_seconds_per_token(plain.run([prompt])[0][0]))
                bench.configure(k)
                outputs = counted.run(bench, True, [prompt], None if a is None else [reference],
                                      a or 0.0, round_)
                ratios["speedup"].append(plain_times[-1] / decode_seconds_per_token(outputs[0]))
                diverged.append(first_divergence(outputs[0].token_ids, reference))
            measured = counted.acceptance()
            step = times and times.at(times.speculative[k], 1)
            rows.append({"k": k, "a": a, **medians(ratios),
                         "expected": step and expected_tokens(measured["a_measured"], k)
                         * statistics.median(plain_times) / step,
                         "speculative_step_ms": step and step * 1e3,
                         "diverged_at": next((d for d in diverged if d is not None), None),
                         **measured})
            print(json.dumps(rows[-1]), flush=True)
    return {"draft_model": args.draft_model,
            "plain_ms_per_token": statistics.median(plain_times) * 1e3,
            "single_stream": rows}


def cost_ratios(bench: Bench) -> tuple[float, dict]:
    """c: the n-gram proposer's host time per draft over one decode step T(1); and the
    verification step's cost over T(1) per k, both from the startup measurement."""
    times = bench.step_times
    cfg = bench.llm.engine.config.speculative
    k = bench.args.batch_k
    if times is None:
        return 0.0, {}
    plain = times.at(times.plain, 1)
    c = proposer_seconds(cfg, k, bench.args.prompt_len) / k / plain
    return c, {k: times.at(series, 1) / plain for k, series in times.speculative.items()}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.replot:
        replot(json.loads(Path(args.replot).read_text()), Path(args.replot).parent)
        return
    out = Path(args.out)
    rng = random.Random(0)
    if args.draft_model:
        result = draft_model_stream(args, random_tokens(rng, args.prompt_len))
        write_result("spec_draft", {**device_info(), "args": vars(args), **result},
                     out_dir=out)
        return
    bench = Bench(args)
    bench.configure(0)
    bench.run([random_tokens(rng, args.prompt_len)] * 2)  # warm-up
    c, verify_ratio = cost_ratios(bench)
    result = {**device_info(), "args": vars(args), "c": c, "verify_over_decode": verify_ratio,
              "single_stream": single_stream(bench, random_tokens(rng, args.prompt_len), c,
                                             verify_ratio),
              "batches": batches(bench, rng), "ngram": ngram_workload(bench, rng),
              "pipelining": pipelining(bench, random_tokens(rng, args.prompt_len))}
    write_result("spec", result, out_dir=out)
    replot(result, out)


if __name__ == "__main__":
    sys.exit(main())
