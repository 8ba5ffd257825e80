"""Per-row logprobs in one launch: each row's log-softmax at its token, and its top k, without
the [R, V] log-softmax torch would write, widen and sort (torch.topk alone takes ~0.1 ms of
device and ~0.2 ms of host time on an H100 node for a few 50257-wide rows; over a 512-token
prompt's rows, 0.45 ms of device time).

    row r:  | chunk 0 | chunk 1 | ... | chunk 24 |   one program each: the chunk's max m and
                 └─────────┴── partials ──┘         sum of exp(x - m), and its top k (max and
                                                    lowest index, k times), and with ranks how
                                                    many of its logits are >= the token's; the
                                                    last to arrive (arrival counter) merges
                                                    them: logsumexp, the token's logprob and
                                                    rank, the row's top k

`token_logprobs` serves sampled rows (logprobs=k, beam search); `prompt_logprobs` every prompt
position of a request that asks for them, with vLLM's rank of the prompt token (tokens at least
as likely, itself included), counted over the logits: the log-softmax keeps their order.

Logits are sanitised first, as the reference does: NaN and -inf count as -inf, +inf as the
dtype's largest value, and a row with nothing finite is uniform (every logprob -log V). Ties
give the lowest index first. Reference: `engine.worker.layers.token_logprobs`.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.arrival_counters import arrive_last, counters_for, reset_counter
from kernels.pdl import pdl_options, pdl_prologue

CHUNK = 2048  # 25 programs a gpt2 row: enough to spread a few rows over the GPU
MAX_TOP = 32  # the widest top k; the partials' width (vLLM's logprobs go up to 20)
NO_INDEX = tl.constexpr(2 ** 31 - 1)  # above any index: loses every min


@triton.jit
def _sanitized(x, largest):
    """The reference's sanitize: NaN counts as -inf, +inf as the dtype's largest value."""
    x = tl.where(x != x, -float("inf"), x)
    return tl.where(x == float("inf"), largest, x)


@triton.jit
def _take_best(values, indices, left):
    """The largest of `values` where `left`, and its lowest index; `left` without it."""
    best = tl.max(tl.where(left, values, -float("inf")), axis=0)
    index = tl.min(tl.where(left & (values == best), indices, NO_INDEX), axis=0)
    return best, index, left & (indices != index)


@triton.jit
def _logprobs_kernel(x_ptr, rows_ptr, tokens_ptr, max_ptr, sum_ptr, top_value_ptr,
                     top_index_ptr, count_ptr, token_out_ptr, rank_out_ptr, value_out_ptr,
                     index_out_ptr, counter_ptr, V, stride_row, k, largest, log_v,
                     HAS_ROWS: tl.constexpr, RANKS: tl.constexpr, CHUNK: tl.constexpr,
                     CHUNKS_POW2: tl.constexpr, CANDIDATES_POW2: tl.constexpr,
                     MAX_TOP: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    r = tl.program_id(0)
    chunk = tl.program_id(1)
    num_chunks = tl.num_programs(1)
    if HAS_ROWS:
        row = tl.load(rows_ptr + r)
    else:
        row = r.to(tl.int64)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = offs < V
    x = _sanitized(tl.load(x_ptr + row * stride_row + offs, mask=valid,
                           other=-float("inf")).to(tl.float32), largest)
    peak = tl.max(x, axis=0)
    # a chunk with nothing finite sums to 0 (exp(-inf - -inf) is NaN, never selected)
    total = tl.sum(tl.where(x > -float("inf"), tl.exp(x - peak), 0.0), axis=0)
    part = r * num_chunks + chunk
    tl.store(max_ptr + part, peak)
    tl.store(sum_ptr + part, total)
    if RANKS:  # this chunk's logits at least the token's (sanitised alike)
        token_logit = _sanitized(tl.load(x_ptr + row * stride_row
                                         + tl.load(tokens_ptr + row)).to(tl.float32), largest)
        tl.store(count_ptr + part, tl.sum((valid & (x >= token_logit)).to(tl.int32), axis=0))
    alive = valid
    for i in range(0, k):
        best, index, alive = _take_best(x, offs, alive)
        tl.store(top_value_ptr + part * MAX_TOP + i, best)
        tl.store(top_index_ptr + part * MAX_TOP + i, index)
    if arrive_last(counter_ptr + r, num_chunks):
        chunks = tl.arange(0, CHUNKS_POW2)
        ok = chunks < num_chunks
        peaks = tl.load(max_ptr + r * num_chunks + chunks, mask=ok, other=-float("inf"),
                        cache_modifier=".cg")
        totals = tl.load(sum_ptr + r * num_chunks + chunks, mask=ok, other=0.0,
                         cache_modifier=".cg")
        peak = tl.max(peaks, axis=0)
        total = tl.sum(tl.where(peaks > -float("inf"), totals * tl.exp(peaks - peak), 0.0),
                       axis=0)
        dead = peak == -float("inf")  # nothing finite: uniform
        log_total = tl.log(total)  # apart from peak: a peak near the dtype's max absorbs it
        token_logit = _sanitized(tl.load(x_ptr + row * stride_row
                                         + tl.load(tokens_ptr + row)).to(tl.float32), largest)
        tl.store(token_out_ptr + r, tl.where(dead, -log_v, token_logit - peak - log_total))
        if RANKS:
            counts = tl.load(count_ptr + r * num_chunks + chunks, mask=ok, other=0,
                             cache_modifier=".cg")
            tl.store(rank_out_ptr + r, tl.sum(counts, axis=0).to(tl.int64))
        candidates = tl.arange(0, CANDIDATES_POW2)
        taken = (candidates // MAX_TOP < num_chunks) & (candidates % MAX_TOP < k)
        base = r * num_chunks * MAX_TOP
        values = tl.load(top_value_ptr + base + candidates, mask=taken, other=-float("inf"),
                         cache_modifier=".cg")
        indices = tl.load(top_index_ptr + base + candidates, mask=taken, other=NO_INDEX,
                          cache_modifier=".cg")
        left = taken & (indices != NO_INDEX)
        for i in range(0, k):
            best, index, left = _take_best(values, indices, left)
            tl.store(value_out_ptr + r * k + i, tl.where(dead, -log_v, best - peak - log_total))
            tl.store(index_out_ptr + r * k + i, index)
        reset_counter(counter_ptr + r)


def token_logprobs(logits: torch.Tensor, rows: torch.Tensor | None, tokens: torch.Tensor,
                   k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each r, of logits row rows[r] (rows None: row r) as a log-softmax: the logprob of
    tokens[rows[r]], and the top k logprobs (descending) with their token ids. logits [N, V]
    any float dtype with stride(1) == 1; rows distinct int64 [R]; tokens int64 [N]; k <=
    min(MAX_TOP, V). Returns float32 [R], float32 [R, k], int64 [R, k]."""
    token_out, _, value_out, index_out = _launch(logits, rows, tokens, k, ranks=False)
    return token_out, value_out, index_out


def prompt_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each row r of logits [R, V] (any float dtype, stride(1) == 1) as a log-softmax: the
    logprob of targets[r] (int64 [R]) and its rank (how many sanitised logits of the row are
    >= its own: 1 for the likeliest), and the top k <= min(MAX_TOP, V) logprobs (descending)
    with their token ids. Returns float32 [R], int64 [R], float32 [R, k], int64 [R, k]."""
    return _launch(logits, None, targets, k, ranks=True)


def _launch(logits: torch.Tensor, rows: torch.Tensor | None, tokens: torch.Tensor, k: int,
            ranks: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The kernel over rows `rows` (None: every row) of logits; the ranks only if `ranks`."""
    assert logits.dim() == 2 and logits.stride(1) == 1 and logits.is_floating_point()
    assert tokens.dtype == torch.int64 and (rows is None or rows.dtype == torch.int64)
    num_rows, vocab = logits.shape[0] if rows is None else rows.shape[0], logits.shape[1]
    assert 0 <= k <= min(MAX_TOP, vocab)
    device = logits.device
    token_out = torch.empty(num_rows, dtype=torch.float32, device=device)
    rank_out = torch.empty(num_rows, dtype=torch.int64, device=device) if ranks else None
    value_out = torch.empty((num_rows, k), dtype=torch.float32, device=device)
    index_out = torch.empty((num_rows, k), dtype=torch.int64, device=device)
    if num_rows == 0:
        return token_out, rank_out, value_out, index_out
    chunks = triton.cdiv(vocab, CHUNK)
    peaks = torch.empty((num_rows, chunks), dtype=torch.float32, device=device)
    totals = torch.empty_like(peaks)
    counts = torch.empty((num_rows, chunks), dtype=torch.int32, device=device) if ranks else peaks
    top_values = torch.empty((num_rows, chunks, MAX_TOP), dtype=torch.float32, device=device)
    top_indices = torch.empty((num_rows, chunks, MAX_TOP), dtype=torch.int32, device=device)
    _logprobs_kernel[(num_rows, chunks)](
        logits, tokens if rows is None else rows, tokens, peaks, totals, top_values,
        top_indices, counts, token_out, token_out if rank_out is None else rank_out, value_out,
        index_out, counters_for(device, num_rows), vocab, logits.stride(0), k,
        torch.finfo(logits.dtype).max, math.log(vocab), HAS_ROWS=rows is not None,
        RANKS=ranks, CHUNK=CHUNK, CHUNKS_POW2=triton.next_power_of_2(chunks),
        CANDIDATES_POW2=triton.next_power_of_2(chunks * MAX_TOP), MAX_TOP=MAX_TOP,
        num_warps=8, **pdl_options(device))
    return token_out, rank_out, value_out, index_out
