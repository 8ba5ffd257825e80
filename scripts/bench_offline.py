"""Offline throughput, vLLM `bench throughput` style, against HF transformers in the same run.

    python scripts/bench_offline.py --model gpt2 --num-prompts 1000 --input-len 512 --output-len 128

Random token-id prompts (optionally sharing a prefix), output length forced with ignore_eos.
Reports requests/s, output tok/s and total tok/s; the ratio to batched fp16 HF `generate` on the
same checkpoint; and the fraction of a roofline: decode steps read all weights plus the KV of
every running sequence (bytes over measured copy bandwidth), prefill is matmul work (FLOPs over
measured matmul rate). Also sweeps batch size (PNG plot) and checks that device memory does not
grow over back-to-back runs.
"""
from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch
from bench_utils import (BENCH_DIR, checkpoint_for, device_info, matmul_rate, model_bytes, plot,
                         write_result)

from engine import LLM, SamplingParams


def random_prompts(n: int, input_len: int, prefix_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(50256) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(50256) for _ in range(input_len - prefix_len)]
            for _ in range(n)]


def run_engine(llm: LLM, prompts: list[list[int]], output_len: int) -> dict:
    params = SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    seconds = time.perf_counter() - start
    n_out = sum(len(o.token_ids) for o in outputs)
    n_in = sum(len(o.prompt_token_ids) for o in outputs)
    return {"seconds": seconds, "requests_per_s": len(prompts) / seconds,
            "output_tok_per_s": n_out / seconds, "total_tok_per_s": (n_in + n_out) / seconds}


def run_hf(checkpoint: str, prompts: list[list[int]], output_len: int, batch: int) -> dict:
    """Batched fp16 HF generate with sampling, the baseline a user would otherwise run."""
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(checkpoint, torch_dtype=torch.float16).cuda().eval()
    n_out, seconds = 0, 0.0
    for i in range(0, len(prompts), batch):
        ids = torch.tensor(prompts[i:i + batch], device="cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                             max_new_tokens=output_len, min_new_tokens=output_len,
                             pad_token_id=50256)
        torch.cuda.synchronize()
        seconds += time.perf_counter() - start
        n_out += (out.shape[1] - ids.shape[1]) * ids.shape[0]
    del model
    torch.cuda.empty_cache()
    return {"seconds": seconds, "output_tok_per_s": n_out / seconds, "batch": batch,
            "num_prompts": len(prompts)}


def roofline_seconds(checkpoint: str, args, concurrency: int, copy_bw: float,
                     flops: float) -> dict:
    """Lower bound on run time: decode is bound by bytes read, prefill by matmul FLOPs."""
    weight_bytes, cfg = model_bytes(checkpoint)
    kv_bytes_per_token = 2 * cfg["n_layer"] * cfg["n_embd"] * 2
    n, inp, out = args.num_prompts, args.input_len, args.output_len
    decode_steps = -(-n // concurrency) * out
    kv_read = n * sum(inp + t for t in range(out)) * kv_bytes_per_token
    decode_s = (decode_steps * weight_bytes + kv_read) / copy_bw
    attention_flops = 2 * cfg["n_layer"] * cfg["n_embd"] * n * inp * inp  # causal QK^T and PV
    prefill_flops = 2 * (weight_bytes / 2) * n * inp + attention_flops
    prefill_s = prefill_flops / flops
    return {"decode_s": decode_s, "prefill_s": prefill_s, "total_s": decode_s + prefill_s,
            "concurrency": concurrency}


def memory_stability(llm: LLM, args, runs: int = 10) -> dict:
    """Back-to-back runs must leave device memory and the block pool where they found them."""
    allocated, free_blocks = [], []
    for i in range(runs):
        run_engine(llm, random_prompts(64, 128, 0, seed=100 + i), 32)
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
        free_blocks.append(llm.engine.block_manager.num_free_blocks)
    return {"allocated_bytes": allocated, "free_blocks": free_blocks,
            "grew": allocated[-1] > allocated[0] or len(set(free_blocks)) > 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prefix-len", type=int, default=0, help="shared prefix tokens")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--hf-prompts", type=int, default=128, help="0: no HF baseline")
    parser.add_argument("--hf-batch", type=int, default=64)
    parser.add_argument("--sweep", default="1,8,32,64,128,256")
    parser.add_argument("--no-async-scheduling", action="store_true",
                        help="wait for each step before scheduling the next")
    parser.add_argument("--no-mixed-step-graphs", action="store_true",
                        help="run steps with prompt tokens eagerly (CUDA graphs for decode only)")
    parser.add_argument("--out", default=str(BENCH_DIR))
    args = parser.parse_args()

    checkpoint = checkpoint_for(args.model)
    info = device_info()
    info["matmul_flop_per_s"] = matmul_rate()
    llm = LLM(model=checkpoint, device="cuda", dtype="float16", max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              async_scheduling=not args.no_async_scheduling,
              mixed_step_graphs=not args.no_mixed_step_graphs)
    run_engine(llm, random_prompts(16, 64, 0, seed=99), 8)  # warm-up
    prompts = random_prompts(args.num_prompts, args.input_len, args.prefix_len, seed=0)
    ours = run_engine(llm, prompts, args.output_len)
    block_size = llm.engine.config.cache.block_size
    blocks_per_request = -(-(args.input_len + args.output_len) // block_size)
    concurrency = min(args.max_num_seqs, llm.engine.block_manager.num_blocks // blocks_per_request)
    roof = roofline_seconds(checkpoint, args, concurrency, info["copy_bytes_per_s"],
                            info["matmul_flop_per_s"])
    sweep = {}
    for batch in [int(b) for b in args.sweep.split(",") if b]:
        sweep[batch] = run_engine(llm, random_prompts(batch, args.input_len, 0, seed=batch),
                                  args.output_len)["output_tok_per_s"]
    stability = memory_stability(llm, args)
    del llm
    torch.cuda.empty_cache()
    hf = (run_hf(checkpoint, prompts[:args.hf_prompts], args.output_len, args.hf_batch)
          if args.hf_prompts else None)  # --hf-prompts 0: no baseline
    ratio = None if hf is None else ours["output_tok_per_s"] / hf["output_tok_per_s"]
    result = {**info, "args": vars(args), "engine": ours, "hf_transformers": hf,
              "ratio_output_tok_s_vs_hf": ratio,
              "roofline": roof, "fraction_of_roofline": roof["total_s"] / ours["seconds"],
              "sweep_output_tok_per_s": sweep, "memory_stability": stability}
    name = f"offline_{args.model.replace('/', '_')}_{args.input_len}x{args.output_len}"
    path = write_result(name, result, out_dir=Path(args.out))
    plot(path.with_suffix(".png"), list(sweep), {"gpt2-serve": list(sweep.values())},
         "batch size (requests at once)", "output tok/s", f"{args.model}: throughput vs batch")
    against_hf = ("no HF baseline" if hf is None else
                  f"HF {hf['output_tok_per_s']:.0f} out tok/s | ratio {ratio:.1f}x")
    print(f"engine {ours['output_tok_per_s']:.0f} out tok/s, {ours['requests_per_s']:.1f} req/s"
          f" | {against_hf}"
          f" | roofline fraction {result['fraction_of_roofline']:.2f}"
          f" | memory grew: {stability['grew']}")


if __name__ == "__main__":
    main()
