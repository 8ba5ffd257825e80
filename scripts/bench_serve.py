"""Served against offline, in one job: the same workload through `LLM.generate` and through
the HTTP server (its engine core in its own process) driven by `gpt2-bench`.

    python3 scripts/bench_serve.py --model gpt2 --out docs/benchmarks/h100

1. offline: N random prompts (input-len in, output-len out, ignore_eos) and one single stream
2. the server with the model's preset, then gpt2-bench runs:
     burst    N requests at once (the saturation figure: served_to_offline, the median
              of --repeats), for each of --api-server-counts (a server started for each)
     rate20   20 requests/s (TTFT and ITL p99 at low load)
     single   one request at a time (median ITL against offline single-stream decode)
     sweep    --sweep-rates, distinct prompts per rate, with a PNG when matplotlib is there
With --client-cpus the load generator and the server run on disjoint CPUs.
Writes serve_<model>.json (GPU name, every summary, served_to_offline) beside the sweep files.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from bench_utils import ROOT, checkpoint_for, device_info, write_result
from bench_offline import random_prompts, run_engine
from launch import launch_server, parse_cpus, pin_to, stop_server, tree_cpu_seconds
from engine import LLM


def offline(checkpoint: str, preset: Path, args: argparse.Namespace) -> dict:
    llm = LLM(model=checkpoint, config_file=str(preset), device="cuda")
    run_engine(llm, random_prompts(16, 64, 0, seed=99), 8)  # warm-up
    bursts = [run_engine(llm, random_prompts(args.num_prompts, args.input_len, 0, seed=1),
                         args.output_len) for _ in range(args.repeats)]
    burst = sorted(bursts, key=lambda run: run["output_tok_per_s"])[len(bursts) // 2]
    single = run_engine(llm, random_prompts(1, args.input_len, 0, seed=2), args.output_len)
    del llm
    torch.cuda.empty_cache()
    return {"burst": burst, "single_stream_ms_per_token":
            1e3 * single["seconds"] / args.output_len}


def bench(url: str, out: Path, name: str, *flags: str, cpus: set[int] | None) -> dict:
    """One gpt2-bench run on `cpus` (None: any); its summary."""
    result = out / f"serve_{name}.json"
    subprocess.run([sys.executable, "-m", "server.bench.cli", "--base-url", url,
                    "--disable-tqdm", "--percentiles", "50,99",
                    "--result-file", str(result), *flags], cwd=ROOT, check=True,
                   preexec_fn=pin_to(cpus))
    return json.loads(result.read_text())


def burst_with_server_cpu(server_pid: int, url: str, out: Path, name: str, *flags: str,
                          cpus: set[int] | None) -> dict:
    """bench(), plus each server process's CPU use over the run in percent of one CPU
    (`server_cpu_percent`, by pid; the log names the core's and API servers' pids): a
    process near 100 % is the one that limits the burst."""
    before = tree_cpu_seconds(server_pid)
    summary = bench(url, out, name, *flags, cpus=cpus)
    after = tree_cpu_seconds(server_pid)
    duration = summary["runs"][0]["duration"]
    summary["server_cpu_percent"] = {pid: round(100 * (after[pid] - before.get(pid, 0.0))
                                                / duration, 1) for pid in after}
    return summary


def median_run(runs: list[dict]) -> dict:
    """The repeat with the median output throughput (bursts of ~2 s vary run to run)."""
    return sorted(runs, key=lambda run: run["runs"][0]["output_throughput"])[len(runs) // 2]


def low_load_runs(url: str, out: Path, name: str, args: argparse.Namespace,
                  shape: list[str], cpus: set[int] | None) -> dict:
    return {
        "rate20": bench(url, out, f"{name}_rate20", *shape, "--num-prompts", "200",
                        "--request-rate", "20", "--seed", "12", cpus=cpus),
        "single": bench(url, out, f"{name}_single", *shape, "--num-prompts", "20",
                        "--max-concurrency", "1", "--seed", "13", cpus=cpus),
        "sweep": bench(url, out, f"{name}_sweep", *shape, "--num-prompts",
                       str(args.sweep_prompts), "--sweep-rates", args.sweep_rates,
                       "--num-workers", str(args.num_workers), "--seed", "14",
                       "--plot", str(out / f"serve_{name}_sweep.png"), cpus=cpus),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-workers", type=int, default=4)
    parser.add_argument("--api-server-counts", default="1,4",
                        help="a burst per count (server --api-server-count); the last count "
                        "also runs rate20, single and the sweep")
    parser.add_argument("--repeats", type=int, default=1,
                        help="bursts per count, and offline; served_to_offline takes the "
                        "medians")
    parser.add_argument("--sweep-rates", default="10,40,160,640,inf")
    parser.add_argument("--sweep-prompts", type=int, default=200, help="requests per rate")
    parser.add_argument("--client-cpus", help="CPUs for the load generator, in taskset's "
                        "syntax (8-15); the server gets the others, so neither slows the "
                        "other (default: both anywhere)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    args = parser.parse_args()
    client_cpus = parse_cpus(args.client_cpus) if args.client_cpus else None
    server_cpus = os.sched_getaffinity(0) - client_cpus if client_cpus else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = checkpoint_for(args.model)
    preset = ROOT / "configs" / f"{args.model}.yaml"
    info = device_info()
    if server_cpus:  # offline runs on the server's CPUs: the same host for both sides
        os.sched_setaffinity(0, server_cpus)
    ours = offline(checkpoint, preset, args)
    shape = ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    counts = [int(count) for count in args.api_server_counts.split(",")]
    bursts = {}
    for count in counts:  # the last count also runs the low-load and sweep benchmarks
        server, url = launch_server(
            ["--model", checkpoint, "--config", str(preset), "--served-model-name", args.model,
             "--log-interval", "5",
             "--api-server-count", str(count)],
            out / f"serve_{args.model}_api{count}_server.log", cpus=server_cpus)
        name = f"{args.model}_api{count}"
        try:
            bursts[count] = [burst_with_server_cpu(
                server.pid, url, out, f"{name}_burst{repeat}", *shape, "--num-prompts",
                str(args.num_prompts), "--num-workers", str(args.num_workers),
                "--seed", str(11 + repeat), cpus=client_cpus)
                for repeat in range(args.repeats)]
            if count == counts[-1]:
                runs = {"burst": median_run(bursts[count]),
                        **low_load_runs(url, out, name, args, shape, client_cpus)}
        finally:
            stop_server(server)
    burst = runs["burst"]["runs"][0]
    offline_rate = ours["burst"]["output_tok_per_s"]
    result = {**info, "args": vars(args), "offline": ours, "served": runs,
              "served_to_offline": burst["output_throughput"] / offline_rate,
              "served_to_offline_by_api_server_count": {
                  count: [run["runs"][0]["output_throughput"] / offline_rate for run in runs_]
                  for count, runs_ in bursts.items()},
              "single_itl_median_minus_offline_ms": runs["single"]["runs"][0]["median_itl_ms"]
              - ours["single_stream_ms_per_token"]}
    write_result(f"serve_{args.model}", result, out_dir=out)
    for count, runs_ in bursts.items():
        for summary in (run["runs"][0] for run in runs_):
            print(f"{args.model} with {count} API server(s): served "
                  f"{summary['output_throughput']:.0f} out tok/s, offline {offline_rate:.0f}: "
                  f"served_to_offline {summary['output_throughput'] / offline_rate:.2f}; "
                  f"failed {summary['failed']}; client CPU {summary.get('client_cpu_percent')}")
        for run in runs_:
            print(f"  server CPU % by pid: {run['server_cpu_percent']}")


if __name__ == "__main__":
    main()
