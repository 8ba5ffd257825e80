"""The prefill attention kernel's short-q-tile knobs (key tile, stages, split length) on a
speculative verification as the mixed-step graph of 16 tokens runs it: one sequence with
k + 1 = 5 new tokens after its context, 11 padding token rows and 15 padding sequence rows,
block tables as wide as a 1024-token context (so the grid is the graph's), GPT-2-xl's 25
heads and gpt2's 12; beside the decode kernel on one token of the same context (what a plain
step's attention costs), split as a decode graph splits it (max_seq_len 1024).

    python3 scripts/sweep_verify_attention.py --out $OUT

Each kernel timed by bench_kernels.time_ms (CUDA graphs, cold L2). Writes
sweep_verify_attention.json.
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
from bench_kernels import BLOCK_SIZE, HEAD_DIM, paged_batch, time_ms

from kernels import paged_attention as pa

GRAPH_TOKENS, GRAPH_SEQS, QUERIES = 16, 16, 5
# short q tiles' knobs (kernels/paged_attention.py); a split length of 1024, the graph's
# context, is no split
KNOBS = {"SHORT_Q_BLOCK_N": (64, 128), "SHORT_Q_NUM_STAGES": (2, 3),
         "SHORT_Q_SPLIT_LEN": (128, 256, 512, 1024)}


def verification_ms(context: int, heads: int) -> float:
    """The prefill kernel over a graph-padded verification of one sequence (block tables as
    wide as the graph's 1024-token context)."""
    b = paged_batch([QUERIES], [context], heads)
    pad = GRAPH_SEQS - 1
    seq_lens = torch.cat([b["meta"].seq_lens, b["meta"].seq_lens.new_zeros(pad)])
    tables = torch.zeros(GRAPH_SEQS, 1024 // BLOCK_SIZE, dtype=torch.int32, device="cuda")
    tables[0, :b["meta"].block_tables.shape[1]] = b["meta"].block_tables[0]
    starts = torch.tensor([0] + [QUERIES] * GRAPH_SEQS, dtype=torch.int32, device="cuda")
    q = torch.randn(GRAPH_TOKENS, heads, HEAD_DIM, device="cuda", dtype=b["q"].dtype)
    return time_ms(lambda: pa.paged_attention_prefill(
        q, b["k_cache"], b["v_cache"], tables, seq_lens, starts, GRAPH_TOKENS, HEAD_DIM ** -0.5))


def decode_ms(context: int, heads: int) -> float:
    b = paged_batch([1], [context], heads)
    meta = b["meta"]
    return time_ms(lambda: pa.paged_attention_decode(
        b["q"], b["k_cache"], b["v_cache"], meta.block_tables, meta.seq_lens,
        HEAD_DIM ** -0.5, max_seq_len=1024))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    saved = {name: getattr(pa, name) for name in KNOBS}
    rows = []
    for context, heads in itertools.product((320, 1000), (25, 12)):
        rows.append({"kernel": "decode", "context": context, "heads": heads,
                     "us": round(decode_ms(context, heads) * 1e3, 2)})
        print(rows[-1], flush=True)
        for values in itertools.product(*KNOBS.values()):
            knobs = dict(zip(KNOBS, values))
            for name, value in knobs.items():
                setattr(pa, name, value)
            rows.append({"kernel": "prefill", "context": context, "heads": heads, **knobs,
                         "default": knobs == saved,
                         "us": round(verification_ms(context, heads) * 1e3, 2)})
            print(rows[-1], flush=True)
        for name, value in saved.items():
            setattr(pa, name, value)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sweep_verify_attention.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
