"""Kernel microbenchmarks for the GPU node, judged against rooflines measured in the same run.

    python scripts/bench_kernels.py --out docs/benchmarks/ [--sweep]

Each kernel's GPU time is measured inside CUDA graphs, because on the GPU node a Python launch
costs more host time than most of these kernels take on the device (plain do_bench timed the
host): time(graph of [flush L2, kernel]) - time(graph of [flush L2]), each the mean replay of
triton.testing.do_bench_cudagraph, so inputs smaller than L2 are still read from memory. The
torch references cannot be captured (they sync on the host) and are timed with do_bench. Achieved bytes/s count the minimum traffic (each input read once,
each output written once); achieved FLOP/s count the useful (causal) attention FLOPs. They
sit next to the device's copy bandwidth (a 1 GiB device-to-device copy, read + write) and its
fp16 matmul rate, both measured here. Attention is also timed against
torch.nn.functional.scaled_dot_product_attention on the same data unpaged, and against the torch
reference. --sweep also times the tuning knobs of kernels/paged_attention.py and
kernels/sampling.py.
Writes kernels_<device>.json and kernels_<device>.md to --out.
"""
from __future__ import annotations

import argparse
import functools
import json
import re
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench, do_bench_cudagraph

from bench_utils import copy_bandwidth, matmul_rate
from engine.speculative.draft_model.chain_start import slots_at
from engine.worker.attention import (AttentionMetadata, paged_attention_reference,
                              store_kv_reference)
from engine.worker.layers import TORCH_OPS
from engine.worker.layers import sample as sample_reference
from engine.worker.triton_ops import triton_ops
from kernels import paged_attention as pa
from kernels import sampling
from kernels.sampling import row_sample
from kernels.skinny_gemm import (AddNorm, skinny_add_norm_linear,
                                 skinny_add_norm_linear_reference, skinny_linear)
from kernels.store_kv import store_kv

DTYPE = torch.float16
HEAD_DIM = 64
BLOCK_SIZE = 16
TARGETS = [  # (row name, metric, threshold, text)
    ("decode B64 ctx1024 H12", "bw_frac", 0.70, ">= 70% of copy bandwidth"),
    ("decode B64 ctx1024 H25", "bw_frac", 0.70, ">= 70% of copy bandwidth"),
    ("decode B1 ctx1024 H12", "bw_frac", 0.30, ">= 30% of copy bandwidth"),
    ("decode B240 ctx512-640 H12", "bw_frac", 0.80, ">= 80% of copy bandwidth"),
    ("layer_norm 4096x1600", "bw_frac", 0.80, ">= 80% of copy bandwidth"),
    ("prefill B2 ctx1024 H12", "vs_sdpa", 1.00, "no slower than SDPA"),
    ("prefill B8 ctx1024 H12", "vs_sdpa", 1.00, "no slower than SDPA"),
]
DECODE_SWEEP = [(32, 2, 4), (32, 4, 4), (32, 1, 4), (64, 2, 4), (64, 4, 2), (64, 4, 8),
                (64, 8, 4), (128, 4, 4), (128, 8, 4)]
PREFILL_SWEEP = [(64, 32, 4, 2), (64, 64, 4, 3), (128, 64, 4, 2), (128, 64, 8, 3), (64, 128, 4, 2)]
SAMPLE_SWEEP = [(1024, 2), (1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8)]  # (CHUNK, warps)


@functools.lru_cache(maxsize=1)
def _l2_flush_buffer() -> torch.Tensor:
    return torch.empty(256 << 20, dtype=torch.int8, device="cuda")  # several times the L2


def time_ms(fn) -> float:
    """GPU milliseconds of fn with a cold L2, launch overhead excluded (see the docstring)."""
    flush = _l2_flush_buffer()
    fn()  # compile and warm up outside the capture

    def flushed() -> None:
        flush.zero_()
        fn()

    return max(do_bench_cudagraph(flushed, rep=50) - do_bench_cudagraph(flush.zero_, rep=50),
               1e-4)


def host_time_ms(fn) -> float:
    """For the torch references, which sync on the host and so cannot be captured."""
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def measure_roofline() -> dict:
    """Copy bandwidth (bytes read + written per second; plain event timing of 1 GiB copies,
    the same measurement the engine benchmarks use) and fp16 matmul FLOP/s. A graph-timed
    256 MiB copy is kept beside it as a check on the graph-timing method."""
    src = torch.empty(1 << 27, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    return {"copy_bytes_per_s": copy_bandwidth(),
            "graph_timed_copy_bytes_per_s": 2 * src.numel() * 2 / time_ms(
                lambda: dst.copy_(src)) * 1e3,
            "matmul_flop_per_s": matmul_rate()}


def paged_batch(q_lens: list[int], seq_lens: list[int], heads: int) -> dict:
    """A batch on shuffled cache blocks, the same K/V also unpaged ([B, H, ctx, D]) for SDPA."""
    num_seqs, ctx = len(seq_lens), max(seq_lens)
    blocks = -(-ctx // BLOCK_SIZE)
    tables = torch.randperm(num_seqs * blocks, device="cuda").view(num_seqs, blocks).int()
    k_dense, v_dense = (torch.randn(num_seqs, heads, ctx, HEAD_DIM, device="cuda", dtype=DTYPE)
                        for _ in range(2))
    caches = [torch.empty(num_seqs * blocks, BLOCK_SIZE, heads, HEAD_DIM, device="cuda",
                          dtype=DTYPE) for _ in range(2)]
    for cache, dense in zip(caches, (k_dense, v_dense)):
        padded = F.pad(dense, (0, 0, 0, blocks * BLOCK_SIZE - ctx))
        cache[tables.long()] = padded.transpose(1, 2).reshape(num_seqs, blocks, BLOCK_SIZE, heads,
                                                              HEAD_DIM)
    starts = [0] + torch.tensor(q_lens).cumsum(0).tolist()
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64, device="cuda"),
        block_tables=tables, seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device="cuda"),
        max_query_len=max(q_lens), max_seq_len=ctx, query_start_loc_host=starts,
        seq_lens_host=list(seq_lens))
    q = torch.randn(starts[-1], heads, HEAD_DIM, device="cuda", dtype=DTYPE)
    return dict(q=q, k_cache=caches[0], v_cache=caches[1], meta=meta, k=k_dense, v=v_dense)


def own_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> tuple:
    """Each decode row's (k, v, slot) for the fused store: the K/V already cached at its last
    position, so storing them again leaves the cache, and the reference, unchanged."""
    last = meta.seq_lens.long()[:, None] - 1
    slots = slots_at(meta.block_tables.long(), last, BLOCK_SIZE)[:, 0]
    heads = k_cache.shape[2]
    return (k_cache.view(-1, heads, HEAD_DIM)[slots], v_cache.view(-1, heads, HEAD_DIM)[slots],
            slots)


def attention_row(name: str, q_lens: list[int], seq_lens: list[int], heads: int) -> dict:
    b = paged_batch(q_lens, seq_lens, heads)
    q, kc, vc, meta, scale = b["q"], b["k_cache"], b["v_cache"], b["meta"], HEAD_DIM ** -0.5
    if meta.is_decode_only:  # as the decode graphs run it: storing the new token's K/V too
        new_kv = own_kv(kc, vc, meta)
        ours = lambda: pa.paged_attention_decode(q, kc, vc, meta.block_tables, meta.seq_lens,
                                                 scale, max_seq_len=meta.max_seq_len,
                                                 new_kv=new_kv)
    else:
        ours = lambda: pa.paged_attention_prefill(q, kc, vc, meta.block_tables, meta.seq_lens,
                                                  meta.query_start_loc, meta.max_query_len, scale)
    ref = lambda: paged_attention_reference(q, kc, vc, meta, scale)
    row = {"name": name, "ms": time_ms(ours), "ref_ms": host_time_ms(ref),
           "max_err": (ours().float() - ref().float()).abs().max().item()}
    if len(set(q_lens)) == 1 and q_lens[0] in (1, seq_lens[0]) and len(set(seq_lens)) == 1:
        q_dense = q.view(len(q_lens), q_lens[0], heads, HEAD_DIM).transpose(1, 2)
        causal = q_lens[0] > 1
        row["sdpa_ms"] = time_ms(lambda: F.scaled_dot_product_attention(
            q_dense, b["k"], b["v"], is_causal=causal, scale=scale))
    kv_bytes = 2 * sum(seq_lens) * heads * HEAD_DIM * DTYPE.itemsize
    visible = sum(s * n - n * (n - 1) // 2 for n, s in zip(q_lens, seq_lens))  # causal pairs
    row["bytes"] = kv_bytes + 2 * q.numel() * DTYPE.itemsize
    row["flops"] = 4 * visible * heads * HEAD_DIM
    return row


def elementwise_rows() -> list[dict]:
    """LayerNorm, fused add+LayerNorm and the KV store, against the torch ops."""
    x, r = (torch.randn(4096, 1600, device="cuda", dtype=DTYPE) for _ in range(2))
    w, b = (torch.randn(1600, device="cuda", dtype=DTYPE) for _ in range(2))
    k, v = (torch.randn(2048, 12, HEAD_DIM, device="cuda", dtype=DTYPE) for _ in range(2))
    caches = [torch.zeros(4096, BLOCK_SIZE, 12, HEAD_DIM, device="cuda", dtype=DTYPE)
              for _ in range(4)]
    slots = torch.randperm(4096 * BLOCK_SIZE, device="cuda")[:2048]

    def both(run):  # the Triton op and the torch op as zero-argument callables
        return (lambda: run(triton_ops())), (lambda: run(TORCH_OPS))

    def store(fn, k_cache, v_cache):
        fn(k, v, k_cache, v_cache, slots)
        return k_cache  # the error check looks at K; V takes the same path

    return [
        op_row("layer_norm 4096x1600", 2 * x.numel(),
               *both(lambda ops: ops.layer_norm(x, w, b, 1e-5))),
        op_row("add_layer_norm 4096x1600", 4 * x.numel(),
               *both(lambda ops: ops.add_layer_norm(x, r, w, b, 1e-5)[0])),
        op_row("store_kv 2048 tok H12", 4 * k.numel(),
               lambda: store(store_kv, *caches[:2]),
               lambda: store(store_kv_reference, *caches[2:])),
    ]


def sampling_rows(tag: str = "") -> list[dict]:
    """Temperature draws from fp32 logits (what the decode graphs capture) against the torch
    reference of the same hashed-noise race; bytes: the logits, read once."""
    rows = []
    for batch in (1, 64, 256):
        logits = torch.randn(batch, 50257, device="cuda") * 3
        temperature = torch.ones(batch, device="cuda")
        seeds = torch.randint(0, 2 ** 62, (batch,), device="cuda")
        row = op_row(f"sample B{batch} V50257{tag}", 0,
                     lambda: row_sample(logits, temperature, seeds),
                     lambda: sample_reference(logits, temperature, seeds))
        row["bytes"] = logits.numel() * logits.element_size()
        rows.append(row)
    return rows


def op_row(name: str, elements: int, ours, ref) -> dict:
    """ours / ref: zero-argument callables returning the output tensor."""
    return {"name": name, "ms": time_ms(ours), "ref_ms": host_time_ms(ref),
            "max_err": (ours().float() - ref().float()).abs().max().item(),
            "bytes": elements * DTYPE.itemsize, "flops": 0}


def attention_rows() -> list[dict]:
    rows = [attention_row(f"decode B{b} ctx{c} H{h}", [1] * b, [c] * b, h)
            for b, c, h in [(64, 1024, 12), (64, 1024, 25), (1, 1024, 12), (256, 512, 12)]]
    rows.append(offline_decode_row())
    rows += [attention_row(f"prefill B{b} ctx1024 H12", [1024] * b, [1024] * b, 12)
             for b in (2, 8)]
    rows.append(attention_row("prefill chunk 512 after 512 cached, B4 H12", [512] * 4, [1024] * 4,
                              12))
    rows.append(attention_row("verify 5 tok B64 ctx1024 H12", [5] * 64, [1024] * 64, 12))
    return rows


def offline_decode_row(tag: str = "") -> dict:
    """The offline benchmark's decode steps: up to 256 rows, each 512-640 tokens in."""
    lens = torch.randint(512, 641, (240,), generator=torch.Generator().manual_seed(0)).tolist()
    return attention_row("decode B240 ctx512-640 H12" + tag, [1] * 240, lens, 12)


def skinny_rows() -> list[dict]:
    """The weight-streaming GEMM against F.linear on GPT-2 small / XL layer shapes."""
    rows = []
    for width in (768, 1600):
        layers = [("qkv", 3 * width, width, False), ("fc+gelu", 4 * width, width, True),
                  ("proj", width, 4 * width, False)]
        for name, n, k, gelu in layers:
            w = torch.randn(n, k, device="cuda", dtype=DTYPE) / k ** 0.5
            b = torch.randn(n, device="cuda", dtype=DTYPE)
            for m in (1, 16):
                x = torch.randn(m, k, device="cuda", dtype=DTYPE)
                act = (lambda y: F.gelu(y, approximate="tanh")) if gelu else (lambda y: y)
                row = op_row(f"skinny {name} E{width} M{m}", n * k + m * (n + k),
                             lambda: skinny_linear(x, w, b, gelu), lambda: act(F.linear(x, w, b)))
                row["flops"] = 2 * m * n * k
                rows.append(row)
                if k == width:  # QKV and FC also come with the block's add + LayerNorm fused
                    rows.append(add_norm_row(f"skinny add_ln+{name} E{width} M{m}", x, w, b,
                                             gelu))
    return rows


def add_norm_row(name: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
                 gelu: bool) -> dict:
    """The fused add + LayerNorm + GEMM against the torch reference of the same three ops."""
    (m, k), n = x.shape, w.shape[0]
    norm = AddNorm(torch.randn_like(x), torch.randn(k, device="cuda", dtype=DTYPE),
                   torch.randn(k, device="cuda", dtype=DTYPE), 1e-5)
    row = op_row(name, n * k + m * (n + 3 * k),
                 lambda: skinny_add_norm_linear(x, norm, w, b, gelu)[0],
                 lambda: skinny_add_norm_linear_reference(x, norm, w, b, gelu)[0])
    row["flops"] = 2 * m * n * k
    return row


def sweep_rows() -> list[dict]:
    """The attention and sampling cases again under other tuning knobs (restored
    afterwards)."""
    rows, saved = [], {k: getattr(pa, k) for k in dir(pa) if k.startswith(("DECODE_", "PREFILL_"))}
    for block_n, warps, per_sm in DECODE_SWEEP:
        pa.DECODE_BLOCK_N, pa.DECODE_NUM_WARPS, pa.DECODE_PROGRAMS_PER_SM = block_n, warps, per_sm
        tag = f" [BLOCK_N={block_n} warps={warps} per_sm={per_sm}]"
        rows += [attention_row(f"decode B{b} ctx1024 H12" + tag, [1] * b, [1024] * b, 12)
                 for b in (1, 64)]
        rows.append(offline_decode_row(tag))
    for attr, value in saved.items():
        setattr(pa, attr, value)
    for bm, bn, warps, stages in PREFILL_SWEEP:
        pa.PREFILL_BLOCK_M, pa.PREFILL_BLOCK_N = bm, bn
        pa.PREFILL_NUM_WARPS, pa.PREFILL_NUM_STAGES = warps, stages
        tag = f" [BM={bm} BN={bn} warps={warps} stages={stages}]"
        rows.append(attention_row("prefill B2 ctx1024 H12" + tag, [1024] * 2, [1024] * 2, 12))
    for attr, value in saved.items():
        setattr(pa, attr, value)
    saved = sampling.CHUNK, sampling.NUM_WARPS
    for chunk, warps in SAMPLE_SWEEP:
        sampling.CHUNK, sampling.NUM_WARPS = chunk, warps
        rows += sampling_rows(f" [CHUNK={chunk} warps={warps}]")
    sampling.CHUNK, sampling.NUM_WARPS = saved
    return rows


def add_rates(rows: list[dict], roof: dict) -> None:
    for row in rows:
        row["bytes_per_s"] = row["bytes"] / row["ms"] * 1e3
        row["bw_frac"] = row["bytes_per_s"] / roof["copy_bytes_per_s"]
        row["flop_per_s"] = row["flops"] / row["ms"] * 1e3
        row["mm_frac"] = row["flop_per_s"] / roof["matmul_flop_per_s"]
        if "sdpa_ms" in row:
            row["vs_sdpa"] = row["sdpa_ms"] / row["ms"]  # > 1: faster than SDPA


def check_targets(rows: list[dict]) -> list[dict]:
    by_name = {row["name"]: row for row in rows}
    return [{"case": name, "target": text, "value": by_name[name][metric],
             "pass": by_name[name][metric] >= threshold}
            for name, metric, threshold, text in TARGETS]


def markdown(info: dict, rows: list[dict], targets: list[dict]) -> str:
    roof = info["roofline"]
    lines = [f"# Kernel benchmarks: {info['device']}", "",
             f"torch {info['torch']}, triton {info['triton']}, fp16, head_dim {HEAD_DIM}, "
             f"block_size {BLOCK_SIZE}. Copy bandwidth {roof['copy_bytes_per_s'] / 1e9:.0f} GB/s "
             f"(read + write; a graph-timed 256 MiB copy gave "
             f"{roof['graph_timed_copy_bytes_per_s'] / 1e9:.0f} GB/s), fp16 matmul "
             f"{roof['matmul_flop_per_s'] / 1e12:.0f} TFLOP/s.", "",
             "| case | ms | GB/s | % copy BW | TFLOP/s | % matmul | SDPA ms | vs SDPA | "
             "torch ref ms | max err |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sdpa = (f"{r['sdpa_ms']:.4f} | {r['vs_sdpa']:.2f}x" if "sdpa_ms" in r else " | ")
        lines.append(f"| {r['name']} | {r['ms']:.4f} | {r['bytes_per_s'] / 1e9:.0f} | "
                     f"{100 * r['bw_frac']:.0f} | {r['flop_per_s'] / 1e12:.1f} | "
                     f"{100 * r['mm_frac']:.1f} | {sdpa} | {r['ref_ms']:.4f} | "
                     f"{r['max_err']:.1e} |")
    lines += ["", "| target | needs | value | result |", "|---|---|---|---|"]
    lines += [f"| {t['case']} | {t['target']} | {t['value']:.2f} | "
              f"{'PASS' if t['pass'] else 'FAIL'} |" for t in targets]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--sweep", action="store_true", help="also time other tuning knobs")
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.cuda.get_device_name()
    info = {"device": device, "torch": torch.__version__, "triton": triton.__version__,
            "roofline": measure_roofline(),
            "knobs": {k: getattr(pa, k) for k in dir(pa) if k.startswith(("DECODE_", "PREFILL_"))}}
    rows = attention_rows() + elementwise_rows() + skinny_rows() + sampling_rows()
    rows += sweep_rows() if args.sweep else []
    add_rates(rows, info["roofline"])
    targets = check_targets(rows)
    report = markdown(info, rows, targets)
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"kernels_{slug}.json").write_text(
        json.dumps({**info, "rows": rows, "targets": targets}, indent=2))
    (args.out / f"kernels_{slug}.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
