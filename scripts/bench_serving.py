"""Load-test a running gpt2-serve (or any OpenAI-compatible completions server), in the style
of `vllm bench serve`: Poisson arrivals, random prompts of a fixed token length, streamed
responses, and the latency numbers serving papers report.

    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --num-prompts 500 \
        --request-rate 20 --input-len 512 --output-len 128 --goodput ttft:200 tpot:50 \
        --result-file bench.json

Prompts are random token ids (sent as token-id prompts, so their length is exact) and every
request sets ignore_eos, so each one generates exactly --output-len tokens.
  TTFT  time to first token (first streamed chunk)
  ITL   inter-token latency (gap between consecutive chunks)
  TPOT  time per output token after the first: (latency - TTFT) / (output tokens - 1)
  goodput  completed requests per second that met every --goodput SLO
Needs httpx (the project's `test` extra).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx
import numpy as np
from tqdm import tqdm

EOS_TOKEN_ID = 50256


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def random_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(EOS_TOKEN_ID) for _ in range(length)] for _ in range(count)]


def arrival_gaps(count: int, rate: float, seed: int) -> list[float]:
    """Poisson process: exponential gaps with mean 1/rate; rate inf sends all at once."""
    if rate == float("inf"):
        return [0.0] * count
    rng = np.random.default_rng(seed)
    return list(rng.exponential(1.0 / rate, size=count))


async def send_one(client: httpx.AsyncClient, model: str, prompt: list[int],
                   output_len: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult(prompt_len=len(prompt))
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                if result.ttft == 0.0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
        result.latency = time.perf_counter() - start
        result.ok = result.ttft > 0
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_load(args: argparse.Namespace, model: str) -> tuple[list[RequestResult], float]:
    prompts = random_prompts(args.num_prompts, args.input_len, args.seed)
    gaps = arrival_gaps(args.num_prompts, args.request_rate, args.seed)
    limit = asyncio.Semaphore(args.max_concurrency or args.num_prompts)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = httpx.Timeout(None, connect=30.0)
    connections = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=timeout,
                                 limits=connections) as client:
        warmup = await send_one(client, model, prompts[0], min(args.output_len, 4))
        if not warmup.ok:
            raise SystemExit(f"warm-up request failed: {warmup.error}")
        bar = tqdm(total=args.num_prompts, disable=args.disable_tqdm, unit="req")

        async def limited(prompt: list[int]) -> RequestResult:
            async with limit:
                result = await send_one(client, model, prompt, args.output_len)
            bar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        for prompt, gap in zip(prompts, gaps):
            tasks.append(asyncio.create_task(limited(prompt)))
            await asyncio.sleep(gap)
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return results, duration


def distribution_ms(values: list[float], name: str, percentiles: list[float]) -> dict:
    ms = np.array(values or [0.0]) * 1000.0
    stats = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
             f"std_{name}_ms": float(ms.std())}
    stats |= {f"p{p:g}_{name}_ms": float(np.percentile(ms, p)) for p in percentiles}
    return stats


def meets_slos(result: RequestResult, slos: dict[str, float]) -> bool:
    measured = {"ttft": result.ttft, "tpot": result.tpot or 0.0, "e2el": result.latency}
    return all(measured[name] * 1000.0 <= limit for name, limit in slos.items())


def summarize(results: list[RequestResult], duration: float, slos: dict[str, float],
              percentiles: list[float]) -> dict:
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    input_tokens = sum(r.prompt_len for r in done)
    summary = {
        "duration_s": duration, "completed": len(done), "failed": len(results) - len(done),
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    if slos:
        summary["goodput"] = sum(meets_slos(r, slos) for r in done) / duration
    summary |= distribution_ms([r.ttft for r in done], "ttft", percentiles)
    summary |= distribution_ms([r.tpot for r in done if r.tpot is not None], "tpot",
                               percentiles)
    summary |= distribution_ms([gap for r in done for gap in r.itl], "itl", percentiles)
    summary |= distribution_ms([r.latency for r in done], "e2el", percentiles)
    summary["errors"] = sorted({r.error for r in results if not r.ok})[:10]
    return summary


def print_summary(summary: dict) -> None:
    print("=" * 22 + " Serving Benchmark Result " + "=" * 22)
    for key, value in summary.items():
        if key != "errors":
            print(f"{key:<40}{value:>30.2f}" if isinstance(value, float)
                  else f"{key:<40}{value:>30}")
    for error in summary["errors"]:
        print("error:", error)
    print("=" * 70)


def parse_slos(items: list[str]) -> dict[str, float]:
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value:
            raise SystemExit(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        slos[name] = float(value)
    return slos


async def served_model(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers) as client:
        response = await client.get("/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", help="default: the first model /v1/models lists")
    parser.add_argument("--api-key")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second (Poisson); inf sends all at once")
    parser.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--goodput", nargs="*", default=[], metavar="SLO",
                        help="SLOs in ms, e.g. ttft:200 tpot:50 e2el:5000")
    parser.add_argument("--percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-file", help="write the summary and settings as JSON")
    parser.add_argument("--disable-tqdm", action="store_true")
    args = parser.parse_args()
    slos = parse_slos(args.goodput)
    percentiles = [float(p) for p in args.percentiles.split(",")]

    model = asyncio.run(served_model(args))
    results, duration = asyncio.run(run_load(args, model))
    summary = summarize(results, duration, slos, percentiles)
    print_summary(summary)
    if args.result_file:
        settings = {k: v for k, v in vars(args).items() if k != "api_key"}
        settings["request_rate"] = str(args.request_rate)
        with open(args.result_file, "w") as out:
            json.dump({"model": model, "settings": settings, "slos_ms": slos, **summary}, out,
                      indent=2)


if __name__ == "__main__":
    main()
