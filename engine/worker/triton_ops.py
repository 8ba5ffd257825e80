"""The Triton backend: the engine's adapter over kernels/, which imports nothing from engine/.
Only this module and engine/speculative/draft_model/chain_start.py import kernels/."""
from __future__ import annotations

import logging
import os
import time
from dataclasses import replace

import torch
from torch import nn

from engine.worker.attention import AttentionMetadata
from engine.worker.layers import LinearShape, Ops, uses_fp8_gemm
from engine.worker.models.gpt2 import GPT2Config
from engine.worker.one_launch_blocks import one_launch_rows
from engine.worker.quantization import STORAGE
from engine.worker.startup import StartupCache, device_key, source_hash
from kernels import decode_layer
from kernels.block_copy import copy_staged_blocks
from kernels.gather_tokens import gather_tokens
from kernels.gemv import GemvConfig
from kernels.layernorm import add_layer_norm, layer_norm
from kernels.linear import LinearDispatch, LinearWins, gemv_candidates, measure_linear_wins
from kernels.logprobs import prompt_logprobs, token_logprobs
from kernels.paged_attention import paged_attention_decode, paged_attention_prefill
from kernels.sampling import masked_row_sample, row_sample
from kernels.skinny_gemm import TILE_CANDIDATES, TileConfig

log = logging.getLogger(__name__)


def triton_ops(linear_wins: LinearWins | None = None) -> Ops:
    """Fused Triton ops; linears take the skinny GEMM or the GEMV, in its config, where
    linear_wins says (None: cuBLAS for every 16-bit linear, quant_linear for every 8-bit one),
    and fp8 weights after the add + LayerNorm the fp8 GEMM where uses_fp8_gemm says, as in
    the reference ops; blocks run op by op unless GPT2_SERVE_DECODE_LAYER forces one launch
    (`forced_one_launch_rows`; measured_one_launch_blocks adds what startup timed)."""
    linear = LinearDispatch(linear_wins, uses_fp8_gemm)
    rows = forced_one_launch_rows() or 0
    return Ops(layer_norm=layer_norm, add_layer_norm=add_layer_norm, linear=linear,
               add_norm_linear=linear.add_norm_linear, sample=row_sample,
               masked_sample=masked_row_sample, token_logprobs=token_logprobs,
               prompt_logprobs=prompt_logprobs,
               copy_staged_blocks=copy_staged_blocks, gather_tokens=gather_tokens,
               decode_block=decode_block if rows else None, decode_block_rows=rows)


def forced_one_launch_rows() -> int | None:
    """GPT2_SERVE_DECODE_LAYER=1: one launch a block at up to decode_layer.MAX_ROWS rows;
    0: never; unset: as measured at startup (measured_one_launch_blocks)."""
    flag = os.environ.get("GPT2_SERVE_DECODE_LAYER")
    if flag is None:
        return None
    if flag not in ("0", "1"):
        raise ValueError(f"GPT2_SERVE_DECODE_LAYER={flag!r}: expected 0 or 1")
    return decode_layer.MAX_ROWS if flag == "1" else 0


def decode_block(block: nn.Module, hidden: torch.Tensor, residual: torch.Tensor,
                 kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """engine.worker.models.gpt2.Block's forward for a decode step of at most
    decode_layer.MAX_ROWS rows, in one launch (kernels/decode_layer.py)."""
    weights = decode_layer.BlockWeights(
        (block.ln_1.weight, block.ln_1.bias), _linear(block.attn.c_attn),
        _linear(block.attn.c_proj), (block.ln_2.weight, block.ln_2.bias),
        _linear(block.mlp.c_fc), _linear(block.mlp.c_proj), block.ln_1.eps)
    kv = decode_layer.PagedKV(*kv_cache, meta.block_tables, meta.seq_lens, meta.slot_mapping)
    return decode_layer.decode_layer(hidden, residual, weights, kv, block.attn.n_head,
                                     block.attn.scale)


def _linear(module: nn.Module) -> decode_layer.Linear:
    """An nn.Linear or a QuantizedLinear as the kernel takes it."""
    weight = module.weight
    if isinstance(weight, torch.Tensor):
        return decode_layer.Linear(weight, None, module.bias)
    return decode_layer.Linear(weight.data, weight.scale, module.bias)


def measured_triton_ops(shapes: list[LinearShape], batch_sizes: list[int],
                        dtype: torch.dtype, device: torch.device, cache: StartupCache,
                        quantization: str | None = None) -> tuple[Ops, str]:
    """triton_ops with the skinny GEMM or the GEMV wherever one beats the default path on this
    GPU for `shapes` (8-bit weights with `quantization`) at the graphs' `batch_sizes`; and
    "cached" (table from `cache`) or "measured"."""
    key = {**device_key(device), "dtype": str(dtype), "quantization": quantization,
           "shapes": [list(s) for s in shapes], "batch_sizes": list(batch_sizes),
           "tile_candidates": [list(c) for c in TILE_CANDIDATES],
           "gemv_candidates": [list(c) for c in gemv_candidates(quantization is not None)],
           "kernels_source": source_hash("kernels")}
    wins, cached = cache.get_or_measure(
        "linear-table", key,
        lambda: measure_linear_wins(shapes, batch_sizes, dtype, device,
                                    STORAGE[quantization] if quantization else None),
        encode=_encoded_wins,
        decode=lambda rows: {tuple(row[:5]): CONFIG_TYPES[row[5]](*row[6]) for row in rows})
    log.info("fused linear kernels %s faster than the default path for %d of the decode "
             "shapes", "(cached table) are" if cached else "measured", len(wins))
    return triton_ops(wins), "cached" if cached else "measured"


def measured_one_launch_blocks(ops: Ops, cfg: GPT2Config, dtype: torch.dtype,
                               device: torch.device, cache: StartupCache,
                               quantization: str | None, block_size: int) -> Ops:
    """`ops` with one launch a block at the decode row counts where it beat op by op on this
    GPU for cfg's blocks (engine/worker/one_launch_blocks.py; the answer from `cache` when
    stored); as given where GPT2_SERVE_DECODE_LAYER forces a choice, or where the timing
    fails (a warning; nothing stored, so the next start times again): an optional speed-up
    never stops a start."""
    if forced_one_launch_rows() is not None:
        return ops
    key = {**device_key(device), "dtype": str(dtype), "quantization": quantization,
           "block": [cfg.n_embd, cfg.n_head, cfg.n_inner, cfg.n_layer], "block_size": block_size,
           "linear_table": _encoded_wins(ops.linear.wins),
           "source": source_hash("kernels", "engine/worker/models")}
    start = time.perf_counter()
    try:
        (rows, times), cached = cache.get_or_measure(
            "one-launch-blocks", key,
            lambda: one_launch_rows(replace(ops, decode_block=decode_block), TritonAttention(),
                                    cfg, decode_layer.MAX_ROWS, dtype, device, quantization,
                                    block_size),
            encode=lambda value: [value[0], [[r, *t] for r, t in value[1].items()]],
            decode=lambda value: (value[0], {r: (a, b) for r, a, b in value[1]}))
    except Exception:  # a kernel that cannot compile or run here: the blocks run op by op
        log.warning("could not time one launch a block; decode steps run op by op",
                    exc_info=True)
        return ops
    timed = ", ".join(f"{r} row{'s' if r > 1 else ''} {a:.1f} us op by op, {b:.1f} in one"
                      for r, (a, b) in times.items())
    log.info("one launch a block at decode steps of up to %d rows (%s a block: %s; %.1f s)",
             rows, "cached" if cached else "measured", timed, time.perf_counter() - start)
    return replace(ops, decode_block=decode_block if rows else None, decode_block_rows=rows)


def _encoded_wins(table: LinearWins) -> list:
    return [[*shape, type(config).__name__, list(config)] for shape, config in table.items()]


CONFIG_TYPES = {config_type.__name__: config_type for config_type in (TileConfig, GemvConfig)}


class TritonAttention:
    """One new token per sequence: the decode kernel; else the varlen prefill kernel. Both
    store the new K/V. Grids come from AttentionMetadata's host ints: no device sync."""
    name = "triton"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        if meta.is_decode_only and q.shape[0] == meta.num_seqs:  # the decode kernel stores
            return paged_attention_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                          scale, max_seq_len=meta.max_seq_len,
                                          new_kv=(k, v, meta.slot_mapping))
        return paged_attention_prefill(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                       meta.query_start_loc, meta.max_query_len, scale,
                                       new_kv=(k, v, meta.slot_mapping))
