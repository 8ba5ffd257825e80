"""Per-row sampling of the logits in one launch: greedy argmax, or a Gumbel-max draw at a
temperature, with the noise hashed in registers (no RNG state, no noise tensor, no host sync).

torch's argmax reduces a 50257-wide row in one thread block, and torch sampling is a dozen
passes over the logits. Here each row is cut into CHUNK-wide pieces:

    row r:  | chunk 0 | chunk 1 | ... | chunk 49 |    one program each: (max, first index) of
                 └─────────┴── partials ──┘          logits / T + G(seed_r, token), or of the
                                                     logits where T = 0; the last to arrive
                                                     (arrival counter) picks the max, lowest
                                                     index on ties

As torch.argmax: the first index of the maximum, NaN counts as the largest value (a row
holding both NaN and +inf may give the first of either). Reference: `engine.worker.layers.sample`,
whose hash this kernel computes bit for bit.

`masked_row_sample` is the same race over a grammar bitmask (structured outputs), for a subset
of the rows, in place: program (r, chunk) reads that chunk of logits row rows[r] and the
CHUNK / 32 words of bitmask row r that cover it; banned tokens and NaN rank last (-inf), only
allowed tokens compete for the index, and the last to arrive writes out[rows[r]], so the
step's other rows keep their draw. One launch where torch takes a dozen (gather, widen,
unpack the bits, fill, draw, scatter). Reference: `engine.worker.layers.masked_sample`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.arrival_counters import arrive_last, counters_for, reset_counter
from kernels.pdl import pdl_options, pdl_prologue

# a program's piece of a row, and its warps: of 1024-8192 wide and 2-16 warps (fp32 logits,
# H100), 1024 wide with 4 warps was the fastest at 64 and 256 rows, greedy or sampled, and
# within 1.5 us of the best at one row
CHUNK = 1024
NUM_WARPS = 4
NO_INDEX = tl.constexpr(2 ** 31 - 1)  # above any index: loses every min
# lowbias32's multipliers, as the reference's HASH_MULTIPLIERS (a test holds them equal)
HASH_MULTIPLIERS = (0x21F0AAAD, 0x735A2D97)
MULTIPLIER_0 = tl.constexpr(HASH_MULTIPLIERS[0])
MULTIPLIER_1 = tl.constexpr(HASH_MULTIPLIERS[1])


@triton.jit
def _mix32(x):
    """lowbias32 on uint32 (wrapping multiplies, logical shifts): engine.worker.layers._mix32_."""
    x = x ^ (x >> 16)
    x = x * MULTIPLIER_0
    x = x ^ (x >> 15)
    x = x * MULTIPLIER_1
    return x ^ (x >> 15)


@triton.jit
def _gumbel_noise(seed, cols):
    """Gumbel(0, 1) per column from the row's int64 seed: engine.worker.layers.gumbel_noise."""
    seed_lo = seed.to(tl.uint32)  # truncates to the low 32 bits
    seed_hi = (seed >> 32).to(tl.uint32)
    bits = _mix32(_mix32(cols.to(tl.uint32) ^ seed_lo) + seed_hi)
    uniform = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # 2^-23
    return -tl.log(-tl.log(uniform))


@triton.jit
def _race(best, index, best_ptr, index_ptr, counter_ptr, row, chunk, num_chunks,
          CHUNKS_POW2: tl.constexpr):
    """Store this chunk's (best, index) among row `row`'s partials. The program that arrives
    last (arrival counter, then reset) returns (True, the lowest index holding the row's
    maximum: NO_INDEX if every chunk had none); the others (False, NO_INDEX)."""
    tl.store(best_ptr + row * num_chunks + chunk, best)
    tl.store(index_ptr + row * num_chunks + chunk, index)
    winner = tl.full((), NO_INDEX, tl.int32)
    last = arrive_last(counter_ptr + row, num_chunks)
    if last:
        chunks = tl.arange(0, CHUNKS_POW2)
        ok = chunks < num_chunks
        bests = tl.load(best_ptr + row * num_chunks + chunks, mask=ok, other=-float("inf"),
                        cache_modifier=".cg")
        indices = tl.load(index_ptr + row * num_chunks + chunks, mask=ok, other=NO_INDEX,
                          cache_modifier=".cg")
        top = tl.max(bests, axis=0)
        winner = tl.min(tl.where(bests == top, indices, NO_INDEX), axis=0)
        reset_counter(counter_ptr + row)
    return last, winner


@triton.jit
def _sample_kernel(x_ptr, temperature_ptr, seed_ptr, best_ptr, index_ptr, out_ptr, counter_ptr,
                   V, stride_row, CHUNK: tl.constexpr, CHUNKS_POW2: tl.constexpr,
                   USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    num_chunks = tl.num_programs(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_row + offs, mask=offs < V,
                other=-float("inf")).to(tl.float32)
    temperature = tl.load(temperature_ptr + row).to(tl.float32)
    if temperature > 0:
        # div_rn: IEEE division, as torch's, so a row scaled here or by the torch sampler
        # (which then passes T = 1) draws the same token
        x = tl.div_rn(x, temperature) + _gumbel_noise(tl.load(seed_ptr + row), offs)
    x = tl.where(x != x, float("inf"), x)  # NaN ranks first
    best = tl.max(x, axis=0)
    index = tl.min(tl.where((x == best) & (offs < V), offs, NO_INDEX), axis=0)
    last, winner = _race(best, index, best_ptr, index_ptr, counter_ptr, row, chunk,
                         num_chunks, CHUNKS_POW2)
    if last:
        tl.store(out_ptr + row, winner)


def row_sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V], temperature [B] (0: greedy; float32 or float64, used as float32),
    seeds int64 [B] -> int64 [B]: `out` (contiguous) if given, else a new tensor."""
    assert logits.dim() == 2 and logits.stride(1) == 1
    assert temperature.is_floating_point() and seeds.dtype == torch.int64
    rows, vocab = logits.shape
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    assert out.shape == (rows,) and out.dtype == torch.int64 and out.stride(0) == 1
    if rows == 0 or vocab == 0:
        return out.zero_()
    chunks = triton.cdiv(vocab, CHUNK)
    best = torch.empty((rows, chunks), dtype=torch.float32, device=logits.device)
    index = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    _sample_kernel[(rows, chunks)](logits, temperature, seeds, best, index, out,
                                   counters_for(logits.device, rows), vocab, logits.stride(0),
                                   CHUNK=CHUNK, CHUNKS_POW2=triton.next_power_of_2(chunks),
                                   num_warps=NUM_WARPS, **pdl_options(logits.device))
    return out


@triton.jit
def _masked_sample_kernel(x_ptr, rows_ptr, mask_ptr, temperature_ptr, seed_ptr, best_ptr,
                          index_ptr, out_ptr, counter_ptr, V, stride_row, stride_mask,
                          CHUNK: tl.constexpr, CHUNKS_POW2: tl.constexpr,
                          USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    r = tl.program_id(0)
    chunk = tl.program_id(1)
    num_chunks = tl.num_programs(1)
    row = tl.load(rows_ptr + r)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    words = tl.load(mask_ptr + r.to(tl.int64) * stride_mask + offs // 32, mask=offs < V,
                    other=0)
    allowed = ((words >> (offs % 32)) & 1) != 0  # False past the vocabulary
    x = tl.load(x_ptr + row * stride_row + offs, mask=offs < V,
                other=-float("inf")).to(tl.float32)
    temperature = tl.load(temperature_ptr + r).to(tl.float32)
    if temperature > 0:
        x = tl.div_rn(x, temperature) + _gumbel_noise(tl.load(seed_ptr + r), offs)
    x = tl.where(allowed & (x == x), x, -float("inf"))  # banned tokens and NaN rank last
    best = tl.max(x, axis=0)
    # only allowed tokens compete for the index: where all are -inf, the first of them wins
    index = tl.min(tl.where(allowed & (x == best), offs, NO_INDEX), axis=0)
    last, winner = _race(best, index, best_ptr, index_ptr, counter_ptr, r, chunk, num_chunks,
                         CHUNKS_POW2)
    if last:
        tl.store(out_ptr + row, tl.where(winner == NO_INDEX, 0, winner))  # nothing allowed: 0


def masked_row_sample(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor,
                      temperature: torch.Tensor, seeds: torch.Tensor, out: torch.Tensor) -> None:
    """For each r: out[rows[r]] = the draw of row rows[r] of `logits` [N, V] over the tokens
    that row r of `bitmask` allows (int32 [R, >= ceil(V / 32)], bit t % 32 of word t // 32),
    at temperature[r] (float, 0: greedy) and seeds[r] (int64). rows: distinct int64 [R];
    rows, seeds and out (int64 [N]) contiguous. The other entries of `out` are left as they
    are. NaN counts as -inf; ties and a row whose allowed tokens are all -inf give the lowest
    allowed index, a row that allows nothing 0. With finite logits, the token `row_sample`
    draws from the row with its banned tokens set to -inf."""
    assert logits.dim() == 2 and logits.stride(1) == 1 and bitmask.stride(1) == 1
    assert bitmask.dtype == torch.int32 and temperature.is_floating_point()
    assert rows.dtype == seeds.dtype == out.dtype == torch.int64 and out.stride(0) == 1
    num_rows, vocab = rows.shape[0], logits.shape[1]
    if num_rows == 0:
        return
    if vocab == 0:
        out[rows] = 0
        return
    assert bitmask.shape[0] == num_rows and bitmask.shape[1] * 32 >= vocab
    chunks = triton.cdiv(vocab, CHUNK)
    best = torch.empty((num_rows, chunks), dtype=torch.float32, device=logits.device)
    index = torch.empty((num_rows, chunks), dtype=torch.int32, device=logits.device)
    _masked_sample_kernel[(num_rows, chunks)](
        logits, rows, bitmask, temperature, seeds, best, index, out,
        counters_for(logits.device, num_rows), vocab, logits.stride(0), bitmask.stride(0),
        CHUNK=CHUNK, CHUNKS_POW2=triton.next_power_of_2(chunks), num_warps=NUM_WARPS,
        **pdl_options(logits.device))
