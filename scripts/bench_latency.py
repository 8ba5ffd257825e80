"""Single-stream decode latency and TTFT, plus batch-64 decode throughput, against the
compiled plain-PyTorch anchor run in the same job.

    python scripts/bench_latency.py --models gpt2,gpt2-xl --anchor .anchor/compiled_decode_anchor.py

ms/token is the median inter-token gap of one request decoding alone (after its first token),
greedy and at temperature 1 (a sampled token is drawn inside the decode graph too); its floor
is the weight bytes over the measured copy bandwidth. TTFT is measured on a fresh prompt of
--ttft-len tokens (no prefix-cache hit). --quantization int8|fp8 serves 8-bit block linears
(docs/quantization.md); the floor then counts their bytes at one a weight.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from bench_utils import BENCH_DIR, checkpoint_for, device_info, model_bytes, write_result

from engine import LLM, SamplingParams


def generate_timed(llm: LLM, prompts: list[list[int]], output_len: int,
                   temperature: float = 0.0):
    params = SamplingParams(temperature=temperature, max_tokens=output_len, ignore_eos=True)
    return llm.generate(prompts, params, use_tqdm=False)


def single_stream_ms(llm: LLM, output_len: int, rng: random.Random,
                     temperature: float = 0.0) -> float:
    out = generate_timed(llm, [[rng.randrange(50256) for _ in range(128)]], output_len,
                         temperature)[0]
    times = out.metrics[0].token_times
    return statistics.median(b - a for a, b in zip(times, times[1:])) * 1e3


def ttft_ms(llm: LLM, prompt_len: int, rng: random.Random, repeats: int = 5) -> float:
    values = []
    for _ in range(repeats):
        out = generate_timed(llm, [[rng.randrange(50256) for _ in range(prompt_len)]], 1)[0]
        values.append((out.metrics[0].first_token_time - out.metrics[0].arrival_time) * 1e3)
    return statistics.median(values)


def batch_decode_tok_s(llm: LLM, batch: int, output_len: int, rng: random.Random) -> float:
    """Decode-phase throughput: tokens produced between the last first token and the first
    finish, when all `batch` requests are decoding together."""
    prompts = [[rng.randrange(50256) for _ in range(128)] for _ in range(batch)]
    outputs = generate_timed(llm, prompts, output_len)
    start = max(o.metrics[0].first_token_time for o in outputs)
    end = min(o.metrics[0].finish_time for o in outputs)
    tokens = sum(sum(1 for t in o.metrics[0].token_times if start < t <= end) for o in outputs)
    return tokens / (end - start)


def bench_model(name: str, args, copy_bw: float) -> dict:
    checkpoint = checkpoint_for(name)
    llm = LLM(model=checkpoint, device="cuda", dtype="float16", max_num_seqs=args.batch,
              mixed_step_graphs=not args.no_mixed_step_graphs, quantization=args.quantization)
    rng = random.Random(0)
    generate_timed(llm, [[1] * 64] * 4, 16)  # warm-up
    ms = single_stream_ms(llm, args.output_len, rng)
    floor_ms = served_weight_bytes(checkpoint, args.quantization) / copy_bw * 1e3
    result = {"decode_ms_per_token_b1": ms, "weight_floor_ms": floor_ms,
              "ratio_to_floor": ms / floor_ms,
              "decode_ms_per_token_b1_temperature_1": single_stream_ms(llm, args.output_len, rng,
                                                                       temperature=1.0),
              "ttft_ms": ttft_ms(llm, args.ttft_len, rng),
              f"decode_tok_per_s_b{args.batch}": batch_decode_tok_s(llm, args.batch,
                                                                   args.output_len, rng)}
    del llm
    torch.cuda.empty_cache()
    return result


def served_weight_bytes(checkpoint: str, quantization: str | None) -> int:
    """The fp16 weights' bytes, less one a weight of the blocks' linears (12 d^2 a layer)
    when they are 8-bit."""
    fp16_bytes, cfg = model_bytes(checkpoint)
    if quantization is None:
        return fp16_bytes
    return fp16_bytes - cfg["n_layer"] * 12 * cfg["n_embd"] ** 2


def run_anchor(path: str) -> dict:
    """The anchor prints JSON lines, the full result last."""
    proc = subprocess.run([sys.executable, path], capture_output=True, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return {"error": (proc.stderr or proc.stdout)[-1000:]}
    return json.loads(lines[-1])


def compare(ours: dict, anchor: dict, name: str, batch: int) -> dict:
    b1 = anchor.get(f"{name}_B1_reduce-overhead", {})
    bn = anchor.get(f"{name}_B{batch}_reduce-overhead", {})
    out = {}
    if "ms_per_step" in b1:
        out["speedup_b1_vs_anchor"] = b1["ms_per_step"] / ours["decode_ms_per_token_b1"]
    if "tok_s" in bn:
        out[f"speedup_b{batch}_vs_anchor"] = ours[f"decode_tok_per_s_b{batch}"] / bn["tok_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,gpt2-xl")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--ttft-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--anchor", help="path to compiled_decode_anchor.py, run in this job")
    parser.add_argument("--no-mixed-step-graphs", action="store_true",
                        help="run steps with prompt tokens eagerly (TTFT's prefill among them)")
    parser.add_argument("--quantization", choices=("int8", "fp8"),
                        help="8-bit weights for the blocks' linears (default: fp16)")
    parser.add_argument("--out", default=str(BENCH_DIR))
    args = parser.parse_args()
    info = device_info()
    result = {**info, "args": vars(args), "models": {}}
    for name in args.models.split(","):
        result["models"][name] = bench_model(name, args, info["copy_bytes_per_s"])
        print(name, json.dumps(result["models"][name]), flush=True)
    if args.anchor:
        result["anchor"] = run_anchor(args.anchor)
        for name, ours in result["models"].items():
            ours.update(compare(ours, result["anchor"], name, args.batch))
    write_result("latency", result, out_dir=Path(args.out))
    for name, r in result["models"].items():
        print(f"{name}: {r['decode_ms_per_token_b1']:.3f} ms/token (floor "
              f"{r['weight_floor_ms']:.3f}, x{r['ratio_to_floor']:.2f}; temperature 1: "
              f"{r['decode_ms_per_token_b1_temperature_1']:.3f}), TTFT {r['ttft_ms']:.2f} ms,"
              f" B{args.batch} {r[f'decode_tok_per_s_b{args.batch}']:.0f} tok/s, vs anchor: "
              f"{ {k: round(v, 2) for k, v in r.items() if 'anchor' in k} }")


if __name__ == "__main__":
    main()
