"""Load-test a running gpt2-serve (or any OpenAI-compatible completions server), in the style
of `vllm bench serve`: Poisson arrivals, streamed responses, vLLM's labelled report.

    gpt2-bench --base-url http://127.0.0.1:8000 --num-prompts 500 --request-rate 20 \\
        --input-len 512 --output-len 128 --goodput ttft:200 tpot:50 --plot cdf.png
    gpt2-bench --sweep-rates 10,40,160,640,inf --num-prompts 1000 --num-workers 4 \\
        --plot sweep.png --result-file sweep.json

Every request sets ignore_eos, so each generates exactly its output length. Each rate of a
sweep sends prompts no other rate sent, so none hits another's prefix cache.

Ctrl-C stops the run: the report (and --result-file, --plot) covers the requests finished so
far, and the exit code is 130.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

try:
    from server.bench import client
except ImportError as missing:  # aiohttp comes with the `bench` extra, not with the server
    raise SystemExit(f"gpt2-bench needs {missing.name}: pip install 'gpt2-serve[bench]' "
                     f"(or pip install -e '.[bench]' in a checkout)") from None
from server.bench import plots
from server.bench.metrics import SLO_METRICS, report, summarize
from server.bench.workload import (SEED_STRIDE, Prompt, WorkloadError, arrival_offsets,
                                   jsonl_prompts, random_prompts, shared_prefix_prompts,
                                   warmup_prompt)

DATASETS = ("random", "shared-prefix", "jsonl")
INTERRUPTED_EXIT = 130  # a shell's code for a command ended by SIGINT


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpt2-bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", help="default: the first model /v1/models lists")
    parser.add_argument("--api-key")
    parser.add_argument("--num-prompts", type=int, default=200, help="requests per rate")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second (Poisson); inf sends all at once")
    parser.add_argument("--sweep-rates", help="comma-separated rates run one after another, "
                        "e.g. 10,40,160,inf (replaces --request-rate)")
    parser.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    parser.add_argument("--num-workers", type=int, default=1,
                        help="client processes the requests are dealt to")
    parser.add_argument("--dataset-name", choices=DATASETS, default="random")
    parser.add_argument("--dataset-path", help="JSONL prompt file (--dataset-name jsonl)")
    parser.add_argument("--input-len", type=int, default=512, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=128,
                        help="output tokens (a JSONL line's output_len wins)")
    parser.add_argument("--shared-prefix-len", type=int, default=256,
                        help="shared-prefix: tokens of the prefix every group shares")
    parser.add_argument("--num-prefixes", type=int, default=8,
                        help="shared-prefix: how many distinct prefixes (groups)")
    parser.add_argument("--goodput", nargs="*", default=[], metavar="SLO",
                        help="SLOs in ms, e.g. ttft:200 tpot:50 e2el:5000")
    parser.add_argument("--percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", help="PNG: TTFT and ITL CDFs, or with --sweep-rates p50/p99 "
                        "TTFT and ITL and output tok/s against offered load")
    parser.add_argument("--result-file", help="write the settings and results as JSON")
    parser.add_argument("--replot", metavar="RESULT_FILE", help="send nothing: draw --plot's "
                        "sweep plot from the --result-file of an earlier --sweep-rates run "
                        "(made where matplotlib was not installed)")
    parser.add_argument("--disable-tqdm", action="store_true")
    return parser


def parse_slos(items: list[str]) -> dict[str, float]:
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        try:
            slos[name] = float(value)
        except ValueError:
            slos[name] = -1.0
        if name not in SLO_METRICS or slos[name] <= 0:
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS with MS > 0, "
                             f"got {item!r}")
    return slos


def parse_numbers(text: str, flag: str, low: float, high: float) -> list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated numbers, got {text!r}") from None
    if not all(low < v <= high for v in values):
        raise ValueError(f"{flag} values must be in ({low:g}, {high:g}], got {text!r}")
    return values


def check_args(args: argparse.Namespace) -> None:
    for flag, value in (("--num-prompts", args.num_prompts), ("--input-len", args.input_len),
                        ("--output-len", args.output_len), ("--num-workers", args.num_workers)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.num_workers > args.num_prompts:
        raise ValueError(f"--num-workers {args.num_workers} exceeds --num-prompts "
                         f"{args.num_prompts}")
    if args.max_concurrency is not None and args.max_concurrency < args.num_workers:
        raise ValueError("--max-concurrency must be >= --num-workers (it is split over them)")
    if (args.dataset_name == "jsonl") != bool(args.dataset_path):
        raise ValueError("--dataset-path goes with --dataset-name jsonl, and only with it")
    if args.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {args.request_rate}")


def workload(args: argparse.Namespace, run: int) -> list[Prompt]:
    """Run `run` of a sweep: its own seed, or its own slice of the JSONL file."""
    seed = args.seed + run * SEED_STRIDE
    if args.dataset_name == "jsonl":
        return jsonl_prompts(args.dataset_path, args.num_prompts, args.output_len,
                             skip=run * args.num_prompts)
    if args.dataset_name == "shared-prefix":
        return shared_prefix_prompts(args.num_prompts, args.input_len, args.output_len,
                                     args.shared_prefix_len, args.num_prefixes, seed)
    return random_prompts(args.num_prompts, args.input_len, args.output_len, seed)


class Interrupted(Exception):
    """Ctrl-C stopped the benchmark; `runs` are the (results, summary) reported so far."""

    def __init__(self, runs: list) -> None:
        super().__init__("interrupted")
        self.runs = runs


def run_rate(args: argparse.Namespace, target: client.Target, rate: float, run: int,
             percentiles: list[float], slos: dict[str, float]):
    """Send one rate's workload and print its report: (results, summary). A Ctrl-C ends it
    with the report of the requests finished so far, then raises Interrupted."""
    prompts = workload(args, run)
    offsets = arrival_offsets(len(prompts), rate, args.seed + run * SEED_STRIDE)
    outcome = client.run_workers(target, prompts, offsets, args.num_workers,
                                 args.max_concurrency, not args.disable_tqdm)
    if outcome.interrupted:
        print(f"interrupted: {len(outcome.results)} of {len(prompts)} requests finished",
              flush=True)
        if not outcome.results:
            raise Interrupted([])
    summary = summarize(outcome.results, outcome.start, percentiles, slos)
    summary["request_rate"] = str(rate)
    summary["client_cpu_percent"] = outcome.cpu_percent
    summary["interrupted"] = outcome.interrupted
    print(report(summary, percentiles, outcome.cpu_percent), flush=True)
    if outcome.interrupted:
        raise Interrupted([(outcome.results, summary)])
    return outcome.results, summary


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.replot:
        replot(parser, args)
        return
    try:
        check_args(args)
        slos = parse_slos(args.goodput)
        percentiles = parse_numbers(args.percentiles, "--percentiles", 0, 100)
        rates = ([args.request_rate] if args.sweep_rates is None
                 else parse_numbers(args.sweep_rates, "--sweep-rates", 0, float("inf")))
        for run in range(len(rates)):  # build every workload now: a bad file fails first
            workload(args, run)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    if args.plot:
        plots.require_matplotlib()
    if args.sweep_rates and 99.0 not in percentiles:
        percentiles.append(99.0)  # the sweep plot draws p99
    runs: list = []
    try:
        model = args.model or asyncio.run(client.served_model(args.base_url, args.api_key))
        target = client.Target(args.base_url, model, args.api_key)
        asyncio.run(client.warm_up(target, warmup_prompt(args.seed)))
        for run, rate in enumerate(rates):
            print(f"request rate {rate:g} req/s: {args.num_prompts} requests", flush=True)
            runs.append(run_rate(args, target, rate, run, percentiles, slos))
    except Interrupted as stop:
        runs += stop.runs
        if runs:
            write_outputs(args, model, rates[:len(runs)], runs, slos)
        sys.exit(INTERRUPTED_EXIT)
    except KeyboardInterrupt:  # before any request was sent
        print("gpt2-bench: interrupted", file=sys.stderr)
        sys.exit(INTERRUPTED_EXIT)
    except (RuntimeError, WorkloadError, OSError) as exc:
        sys.exit(f"gpt2-bench: error: {exc}")
    except (client.aiohttp.ClientError, TimeoutError) as exc:
        sys.exit(f"gpt2-bench: error: {args.base_url}: {exc}")
    write_outputs(args, model, rates, runs, slos)


def write_outputs(args: argparse.Namespace, model: str, rates: list[float], runs: list,
                  slos: dict[str, float]) -> None:
    labels = [f"{rate:g}" for rate in rates]
    title = plot_title(model, vars(args))
    if args.plot and args.sweep_rates:
        plots.plot_sweep(labels, [summary for _, summary in runs], args.plot, title)
    elif args.plot:
        plots.plot_cdfs(runs[0][0], args.plot, f"{title}, {labels[0]} req/s")
    if args.plot:
        print(f"wrote {args.plot}")
    if args.result_file:
        settings = {k: v for k, v in vars(args).items() if k != "api_key"}
        settings["request_rate"] = str(args.request_rate)
        with open(args.result_file, "w") as out:
            json.dump({"model": model, "settings": settings, "slos_ms": slos,
                       "runs": [summary for _, summary in runs]}, out, indent=2)
        print(f"wrote {args.result_file}")


def plot_title(model: str, settings: dict) -> str:
    return (f"{model}, {settings['dataset_name']} {settings['input_len']} in / "
            f"{settings['output_len']} out")


def replot(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not args.plot:
        parser.error("--replot needs --plot OUT.png")
    plots.require_matplotlib()
    try:
        saved = json.loads(Path(args.replot).read_text())
        runs, settings, title = saved["runs"], saved["settings"], plot_title(saved["model"],
                                                                              saved["settings"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        parser.error(f"--replot {args.replot}: not a gpt2-bench result file ({exc})")
    if not settings.get("sweep_rates"):
        parser.error(f"--replot {args.replot}: not a --sweep-rates result (a single run's CDFs "
                     f"need per-request times, which result files do not keep)")
    labels = [f"{float(run['request_rate']):g}" for run in runs]
    plots.plot_sweep(labels, runs, args.plot, title)
    print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
