"""One launch per GPT-2 block for a decode step of one or two rows: the block's five steps as
phases of one persistent kernel, separated by grid-wide barriers instead of kernel boundaries.

    program p of P (one per SM), each phase over every program:
    1  rows [p R, (p + 1) R) of W_qkv    qkv = LN_1(h + r) W_qkv^T + b (program 0 stores s1 = h + r)
       ---- barrier 1 ----
    2  items (row, head, split) p, p + P, ...   attention over the paged cache, the new K/V
                                                stored; each head's splits merged by the last
       ---- barrier 2 ----
    3  rows of W_o                       o = attn W_o^T + b
       ---- barrier 3 ----
    4  rows of W_fc                      fc = GELU(LN_2(o + s1) W_fc^T + b) (program 0 stores
                                         s2 = o + s1, the residual the block returns)
       ---- barrier 4 ----
    5  rows of W_proj                    out = fc W_proj^T + b

Why: at batch 1 a block is five short kernels, each paying its ramp and tail beside its bytes
(about 3.5 us a GEMV). Here each phase's weights stream with no launch between them: a program
takes its phase's rows as one contiguous range (R = ceil(N / P), so every program reads the
same bytes to within a row), streams them in [BLOCK_N, BLOCK_K] tiles loaded two ahead of use,
and before each barrier loads its first tile of the next linear phase, so the wait overlaps
that load (weights depend on nothing).

The barrier is one counter, bumped by each program (release) and polled (acquire) until it
reaches n * P at barrier n; the last program out resets it to zero. It needs every program
resident at once: P is the SM count, one program per SM, which always fits (at most 8 warps,
255 registers a thread and little shared memory), whatever else the GPU runs. The interpreter
runs programs one after another, where a barrier would never open: there the host launches the
kernel once per phase (PHASES one bit each), the launch boundary standing in for the barrier.

The arithmetic is the unfused kernels' (kernels/gemv.py's add + LayerNorm prologue and
epilogue, kernels/paged_attention.py's split decode), rounding to the activations' dtype at the
same points; only each dot's fp32 summation order differs. 8-bit weights (SCALED) are widened
in registers and scaled per output channel. Reference: the block as engine.worker.models.gpt2
runs it on the reference ops (tests/kernels/test_decode_layer_kernel.py).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.arrival_counters import counters_for
from kernels.device_info import num_sms
from kernels.gemv import _row_stats, normed_slice, widen_to_f32, x_operands
from kernels.paged_attention import LOG2E, attend_split, finish_split
from kernels.pdl import pdl_options, pdl_prologue_loading
from kernels.skinny_gemm import _epilogue

MAX_ROWS = 2  # as the GEMV: beyond, M FMAs a weight and M accumulators
MAX_NORM_K = 4096  # the widest row a program normalises in registers (GPT-2: 1600)
MAX_SPLITS = 16  # attention splits of one (row, head): enough for 132 SMs at one head
MAX_WARPS_PER_SM = 8  # 8 warps x 32 threads x 255 registers fit an SM's 65536
ALL_PHASES = 0b11111  # PHASES (one bit a phase) of the launch with barriers


class DecodeLayerConfig(NamedTuple):
    """Weights a program loads per K step (its rows x the K step), warps a program, the
    attention phase's key tile, and programs per SM: at most MAX_WARPS_PER_SM warps in all, so
    that every program is resident at once whatever its registers (255 a thread at most)."""
    tile_elements: int = 8192
    num_warps: int = 4
    attention_block_n: int = 32
    programs_per_sm: int = 2


class Linear(NamedTuple):
    """weight [N, K] in F.linear's layout, 16-bit, or 8-bit with `scale` float32 [N]."""
    weight: torch.Tensor
    scale: torch.Tensor | None
    bias: torch.Tensor


class BlockWeights(NamedTuple):
    ln_1: tuple[torch.Tensor, torch.Tensor]  # LayerNorm (weight, bias)
    c_attn: Linear  # [3 D, D]
    attn_proj: Linear  # [D, D]
    ln_2: tuple[torch.Tensor, torch.Tensor]
    c_fc: Linear  # [INNER, D], GELU after
    mlp_proj: Linear  # [D, INNER]
    eps: float


class PagedKV(NamedTuple):
    """This layer's caches [num_blocks, block_size, heads, head_dim] and the step's rows:
    block_tables int32 [M, W], seq_lens int32 [M] (with the new token), slot_mapping [M]."""
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor


@triton.jit
def _row_range(N):
    """This program's rows [lo, hi) of an N-row weight (empty for programs past N)."""
    per = tl.cdiv(N, tl.num_programs(0))
    lo = tl.program_id(0) * per
    return lo, tl.minimum(lo + per, N)


@triton.jit
def _first_rows(w_ptr, N, K, BLOCK_N: tl.constexpr):
    lo, hi = _row_range(N)
    return w_ptr + (lo + tl.arange(0, BLOCK_N)).to(tl.int64) * K


@triton.jit
def _first_ok(N, BLOCK_N: tl.constexpr):
    lo, hi = _row_range(N)
    return lo + tl.arange(0, BLOCK_N) < hi


@triton.jit
def _weight_tile(w_ptr, step, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """K step `step` of this program's rows of W [N, K] (at most BLOCK_N); zeros outside
    them (a step past K loads nothing)."""
    lo, hi = _row_range(N)
    rows = lo + tl.arange(0, BLOCK_N)
    cols = step * BLOCK_K + tl.arange(0, BLOCK_K)
    return tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :],
                   mask=(rows < hi)[:, None] & (cols < K)[None, :], other=0.0)


@triton.jit
def _linear_phase(w, x_ptr, res_ptr, ln_w_ptr, ln_b_ptr, sum_ptr, eps, w_ptr, scale_ptr,
                  bias_ptr, out_ptr, M, N, K, GELU: tl.constexpr, SCALED: tl.constexpr,
                  NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, NORM_K: tl.constexpr):
    """out[:, lo:hi] = act(x' @ W[lo:hi]^T (* scale) + bias) for this program's rows (at most
    BLOCK_N), x' = x, or with NORM LayerNorm(x + residual) (program 0 storing x + residual at
    sum_ptr); rows [M, K] contiguous. w: the rows' first K step, already loaded. The loop
    loads W two steps ahead and x's operands one step ahead, so no step waits on a load
    issued in it."""
    lo, hi = _row_range(N)
    rows = tl.arange(0, BLOCK_M)
    mean = tl.zeros([BLOCK_M], tl.float32)
    rstd = tl.zeros([BLOCK_M], tl.float32)
    if NORM:
        mean, var = _row_stats(x_ptr, res_ptr, sum_ptr, rows, M, K, K, tl.program_id(0) == 0,
                               NORM_K)
        rstd = 1.0 / tl.sqrt(var + eps)
    w_next = _weight_tile(w_ptr, 1, N, K, BLOCK_N, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)
    s, gamma, beta = x_operands(x_ptr, res_ptr, ln_w_ptr, ln_b_ptr, rows, offs_k, offs_k < K,
                                M, K, NORM)
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
    for step in range(0, tl.cdiv(K, BLOCK_K)):
        w_after = _weight_tile(w_ptr, step + 2, N, K, BLOCK_N, BLOCK_K)
        offs_k = (step + 1) * BLOCK_K + tl.arange(0, BLOCK_K)
        s_next, gamma_next, beta_next = x_operands(x_ptr, res_ptr, ln_w_ptr, ln_b_ptr, rows,
                                                   offs_k, offs_k < K, M, K, NORM)
        x = normed_slice(s, gamma, beta, mean, rstd, x_ptr.dtype.element_ty, NORM)
        acc += widen_to_f32(w)[None, :, :] * x[:, None, :]
        w, w_next = w_next, w_after
        s, gamma, beta = s_next, gamma_next, beta_next
    offs_n = lo + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hi
    dots = tl.trans(tl.sum(acc, axis=2))  # [BLOCK_N, BLOCK_M]
    if SCALED:
        dots = dots * tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0)[:, None]
    none = tl.zeros([BLOCK_M], tl.float32)  # the epilogue's LayerNorm sums: x is normed here
    y = _epilogue(dots, none, none, K, eps, bias_ptr, offs_n, n_ok, rows, M, True, GELU, False)
    tl.store(out_ptr + rows[None, :] * N + offs_n[:, None], y.to(out_ptr.dtype.element_ty),
             mask=n_ok[:, None] & (rows < M)[None, :])


@triton.jit
def _attention_phase(qkv_ptr, attn_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
                     seq_lens_ptr, slot_ptr, part_out_ptr, part_lse_ptr, counter_ptr, qk_scale,
                     M, stride_bt, stride_slot, stride_ch, D: tl.constexpr,
                     HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     SPLITS: tl.constexpr, MAX_SPLITS: tl.constexpr,
                     ATTENTION_BLOCK_N: tl.constexpr):
    """Items (row, head, split), split s of a row's context being its s-th range of whole key
    tiles (about seq_len / SPLITS positions: the ranges follow the row's length)."""
    dims = tl.arange(0, HEAD_DIM)
    for item in range(tl.program_id(0), M * HEADS * SPLITS, tl.num_programs(0)):
        pair = item // SPLITS  # row * HEADS + head
        split = item % SPLITS
        row = pair // HEADS
        head = pair % HEADS
        seq_len = tl.load(seq_lens_ptr + row)
        per = tl.cdiv(tl.cdiv(seq_len, ATTENTION_BLOCK_N), SPLITS) * ATTENTION_BLOCK_N
        lo = split * per
        hi = tl.minimum(seq_len, lo + per)
        q_ptrs = qkv_ptr + row * 3 * D + head * HEAD_DIM + dims
        q = tl.load(q_ptrs).to(tl.float32) * qk_scale
        o, lse = attend_split(q, q_ptrs + D, q_ptrs + 2 * D, slot_ptr + row, seq_len, lo, hi,
                              k_cache_ptr, v_cache_ptr,
                              block_tables_ptr + row.to(tl.int64) * stride_bt,
                              head * stride_ch, stride_slot, BLOCK_SIZE, HEAD_DIM,
                              ATTENTION_BLOCK_N, True)
        finish_split(o, lse, attn_ptr + row * D + head * HEAD_DIM + dims, part_out_ptr,
                     part_lse_ptr, counter_ptr, pair, split, SPLITS, SPLITS > 1, HEAD_DIM,
                     MAX_SPLITS)


@triton.jit
def _grid_barrier(counter_ptr, number):
    """Block until every program has arrived at barrier `number` (1, 2, ...): the counter
    counts arrivals at every barrier of the launch, so barrier n opens at n * programs. The
    CTA barriers order all threads' stores before the arrival and every read after it."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel") + 1
    while arrived < number * tl.num_programs(0):
        arrived = tl.atomic_add(counter_ptr, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def _tile_then_barrier(w, w_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       barrier_ptr, number, BARRIERS: tl.constexpr):
    """With BARRIERS: load this program's first K step of the next phase's W [N, K], then
    wait at barrier `number` (the load overlaps the wait) and return the tile. Without: the
    launch runs one phase, whose tile is the entry tile w."""
    if BARRIERS:
        tile = _weight_tile(w_ptr, 0, N, K, BLOCK_N, BLOCK_K)
        _grid_barrier(barrier_ptr, number)
    else:
        tile = w
    return tile


@triton.jit
def _leave(counter_ptr, barriers):
    """After the last barrier: the last program out zeroes the counter for the next launch
    (every other program has passed its last wait by then)."""
    if tl.atomic_add(counter_ptr, 1, sem="relaxed") == (barriers + 1) * tl.num_programs(0) - 1:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed")


@triton.jit
def _decode_layer_kernel(
        hidden_ptr, residual_ptr, out_ptr, res_out_ptr, s1_ptr, qkv_ptr, attn_ptr, o_ptr, fc_ptr,
        part_out_ptr, part_lse_ptr, counter_ptr, ln1_w_ptr, ln1_b_ptr, qkv_w_ptr, qkv_s_ptr,
        qkv_b_ptr, o_w_ptr, o_s_ptr, o_b_ptr, ln2_w_ptr, ln2_b_ptr, fc_w_ptr, fc_s_ptr, fc_b_ptr,
        proj_w_ptr, proj_s_ptr, proj_b_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
        seq_lens_ptr, slot_ptr, entry_w_ptr, entry_n, entry_k, eps, qk_scale, M, stride_bt,
        stride_slot, stride_ch, D: tl.constexpr, INNER: tl.constexpr, HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPLITS: tl.constexpr,
        MAX_SPLITS: tl.constexpr, ATTENTION_BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
        ENTRY_N: tl.constexpr, ENTRY_K: tl.constexpr, QKV_N: tl.constexpr, QKV_K: tl.constexpr,
        O_N: tl.constexpr, O_K: tl.constexpr, FC_N: tl.constexpr, FC_K: tl.constexpr,
        PROJ_N: tl.constexpr, PROJ_K: tl.constexpr, NORM_K: tl.constexpr,
        SCALED: tl.constexpr, PHASES: tl.constexpr, BARRIERS: tl.constexpr,
        EARLY: tl.constexpr, USE_PDL: tl.constexpr):
    w = pdl_prologue_loading(USE_PDL, EARLY, _first_rows(entry_w_ptr, entry_n, entry_k, ENTRY_N),
                             _first_ok(entry_n, ENTRY_N), tl.arange(0, ENTRY_K), entry_k)
    barrier_ptr = counter_ptr + M * HEADS  # after the attention pairs' arrival counters
    # without BARRIERS the launch runs one phase, which takes the entry tile w
    if PHASES & 1:
        _linear_phase(w, hidden_ptr, residual_ptr, ln1_w_ptr, ln1_b_ptr, s1_ptr, eps, qkv_w_ptr,
                      qkv_s_ptr, qkv_b_ptr, qkv_ptr, M, 3 * D, D, False, SCALED, True, BLOCK_M,
                      QKV_N, QKV_K, NORM_K)
    w_o = _tile_then_barrier(w, o_w_ptr, D, D, O_N, O_K, barrier_ptr, 1, BARRIERS)
    if PHASES & 2:
        _attention_phase(qkv_ptr, attn_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
                         seq_lens_ptr, slot_ptr, part_out_ptr, part_lse_ptr, counter_ptr,
                         qk_scale, M, stride_bt, stride_slot, stride_ch, D, HEADS, HEAD_DIM,
                         BLOCK_SIZE, SPLITS, MAX_SPLITS, ATTENTION_BLOCK_N)
    if BARRIERS:
        _grid_barrier(barrier_ptr, 2)
    if PHASES & 4:
        _linear_phase(w_o, attn_ptr, attn_ptr, ln1_w_ptr, ln1_b_ptr, s1_ptr, eps, o_w_ptr,
                      o_s_ptr, o_b_ptr, o_ptr, M, D, D, False, SCALED, False, BLOCK_M, O_N, O_K,
                      NORM_K)
    w_fc = _tile_then_barrier(w, fc_w_ptr, INNER, D, FC_N, FC_K, barrier_ptr, 3, BARRIERS)
    if PHASES & 8:
        _linear_phase(w_fc, o_ptr, s1_ptr, ln2_w_ptr, ln2_b_ptr, res_out_ptr, eps, fc_w_ptr,
                      fc_s_ptr, fc_b_ptr, fc_ptr, M, INNER, D, True, SCALED, True, BLOCK_M,
                      FC_N, FC_K, NORM_K)
    w_proj = _tile_then_barrier(w, proj_w_ptr, D, INNER, PROJ_N, PROJ_K, barrier_ptr, 4,
                                BARRIERS)
    if PHASES & 16:
        _linear_phase(w_proj, fc_ptr, fc_ptr, ln2_w_ptr, ln2_b_ptr, s1_ptr, eps, proj_w_ptr,
                      proj_s_ptr, proj_b_ptr, out_ptr, M, D, INNER, False, SCALED, False,
                      BLOCK_M, PROJ_N, PROJ_K, NORM_K)
    if BARRIERS:
        _leave(barrier_ptr, 4)


def decode_layer(hidden: torch.Tensor, residual: torch.Tensor, block: BlockWeights,
                 kv: PagedKV, num_heads: int, scale: float,
                 config: DecodeLayerConfig = DecodeLayerConfig()
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One GPT-2 block for M <= MAX_ROWS decode rows (one new token each): hidden, residual
    [M, D] (the previous branch output and the residual it has not been added to) -> (the MLP
    branch output, the residual s2), as engine.worker.models.gpt2.Block returns them; stores
    the rows' K/V at kv.slot_mapping (-1: not). One launch on a GPU, one per phase under the
    interpreter."""
    m, d = hidden.shape
    inner = block.c_fc.weight.shape[0]
    assert 0 < m <= MAX_ROWS and d <= MAX_NORM_K and hidden.is_contiguous()
    assert residual.is_contiguous() and residual.shape == hidden.shape
    assert kv.k_cache.is_contiguous() and kv.k_cache.stride() == kv.v_cache.stride()
    linears = (block.c_attn, block.attn_proj, block.c_fc, block.mlp_proj)
    scaled = block.c_attn.scale is not None
    assert all((lin.scale is not None) == scaled and lin.weight.is_contiguous()
               for lin in linears)
    head_dim = d // num_heads
    assert config.programs_per_sm * config.num_warps <= MAX_WARPS_PER_SM
    programs = config.programs_per_sm * num_sms(hidden.device)
    splits = max(1, min(MAX_SPLITS, programs // (m * num_heads)))  # an item a program
    tiles = [_tile(*lin.weight.shape, programs, config.tile_elements) for lin in linears]
    new = lambda *shape, dtype=hidden.dtype: torch.empty(shape, dtype=dtype,  # noqa: E731
                                                          device=hidden.device)
    out, res_out, s1, qkv = new(m, d), new(m, d), new(m, d), new(m, 3 * d)
    attn, o, fc = new(m, d), new(m, d), new(m, inner)
    part_out = new(m, num_heads, splits, head_dim, dtype=torch.float32)
    part_lse = new(m, num_heads, splits, dtype=torch.float32)
    counters = counters_for(hidden.device, m * num_heads + 1)
    interpreted = hidden.device.type == "cpu"
    for phases in ((1, 2, 4, 8, 16) if interpreted else (ALL_PHASES,)):
        entry = 0 if phases & 0b11 else phases.bit_length() - 2  # the first linear it runs
        _decode_layer_kernel[(programs,)](
            hidden, residual, out, res_out, s1, qkv, attn, o, fc, part_out, part_lse, counters,
            *block.ln_1, *_linear_args(block.c_attn), *_linear_args(block.attn_proj),
            *block.ln_2, *_linear_args(block.c_fc), *_linear_args(block.mlp_proj),
            kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, kv.slot_mapping,
            linears[entry].weight, *linears[entry].weight.shape, block.eps, scale * LOG2E, m,
            kv.block_tables.stride(0), kv.k_cache.stride(1), kv.k_cache.stride(2), D=d,
            INNER=inner, HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_SIZE=kv.k_cache.shape[1],
            SPLITS=splits, MAX_SPLITS=triton.next_power_of_2(splits),
            ATTENTION_BLOCK_N=config.attention_block_n, BLOCK_M=triton.next_power_of_2(m),
            ENTRY_N=tiles[entry][0], ENTRY_K=tiles[entry][1], QKV_N=tiles[0][0],
            QKV_K=tiles[0][1], O_N=tiles[1][0], O_K=tiles[1][1], FC_N=tiles[2][0],
            FC_K=tiles[2][1], PROJ_N=tiles[3][0], PROJ_K=tiles[3][1],
            NORM_K=triton.next_power_of_2(d), SCALED=scaled, PHASES=phases,
            BARRIERS=phases == ALL_PHASES, EARLY=True, num_warps=config.num_warps, **pdl_options(hidden.device))
    return out, res_out


def _tile(n: int, k: int, programs: int, elements: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) for a linear of W [n, k]: every row a program takes (ceil(n /
    programs)) in one tile of about `elements` weights a K step."""
    block_n = triton.next_power_of_2(triton.cdiv(n, programs))
    return block_n, min(triton.next_power_of_2(k), max(16, elements // block_n))


def _linear_args(linear: Linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight, scale, bias) pointers; a 16-bit weight passes its bias as the unused scale."""
    return linear.weight, linear.bias if linear.scale is None else linear.scale, linear.bias
