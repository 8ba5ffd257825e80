"""Paged attention over the block-table KV cache: a decode kernel and a varlen prefill kernel.

Both walk a sequence's context in tiles of BLOCK_N positions, each position looking up its own
block id, so any power-of-two block size works with any tile size. A tile row is one token's
head vector (HEAD_DIM contiguous elements), so a tile load is BLOCK_N coalesced segments.

    block_table  [ 7 | 2 | 9 ]                 block_size 4, BLOCK_N 8
    positions    0..3  4..7  8..11
    tile 0       |--- blocks 7, 2 ---|         rows = block_id * block_size + pos % block_size
    tile 1                           |-- 9 --|  (positions >= seq_len are masked)

Softmax is online (running max m, running sum l, rescaled accumulator) in fp32, in base 2 with
log2(e) folded into the scale, so no [queries x context] score matrix ever reaches memory.

Decode (one query per sequence) is memory bound. Grid (seq, head, split): with few sequences
the context is cut into `splits` equal ranges (flash-decoding); each program writes its
partial (acc / l, log2-sum-exp) and the last split to finish merges them in the same launch
(kernels/arrival_counters.py):

    seq s, head h:  | split 0 | split 1 | split 2 |  -> partial (o_i, lse_i) each
                    out = sum_i 2^(lse_i - max lse) o_i / sum_i 2^(lse_i - max lse)

Prefill (varlen) is FlashAttention-style: a program holds BLOCK_M queries of one sequence and
walks the context with tl.dot. Grid (tile, head), q tiles numbered sequence after sequence;
each program finds its (sequence, q tile) from the query lengths, so about tokens / BLOCK_M +
sequences programs run per head. The grid depends only on shapes (CUDA graphs capture it):

    q lens   [130, 1, 1, 70]       BLOCK_M 64
    tiles    [  3, 1, 1,  2]       programs 0-2: seq 0; 3: seq 1; 4: seq 2; 5-6: seq 3;
                                   7.. (the grid's bound, ceil(202 / 64) + 4 = 8): exit

A step of at most SHORT_Q_TILE tokens (a one-stream verification) also splits its keys, as
decode does, so its few programs do not walk the context serially; and it stores its own K/V
in the kernel: one q tile a sequence, every cached key visible to all its queries, the new
keys one more tile read from the step's K/V and stored by the program whose split holds them.

Query j of a sequence sits at position seq_len - q_len + j (the cached prefix first), so one
kernel serves whole prompts, prefix-cache hits, mid-prompt chunks and verifications. Tiles
wholly before the q tile's first position skip the causal mask:

    keys ->     0 ............ prefix ........ seq_len
    q tile      [ unmasked tiles  ][ masked (diagonal) ]   stop at the tile's last query + 1

The torch reference is `engine.worker.attention.paged_attention_reference`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.arrival_counters import arrive_last, counters_for, reset_counter
from kernels.device_info import num_sms
from kernels.pdl import pdl_options, pdl_prologue
from kernels.store_kv import store_kv

LOG2E = 1.4426950408889634
# tuning knobs, module-level so scripts/bench_kernels.py --sweep can try others
DECODE_BLOCK_N = 32
DECODE_NUM_WARPS = 2  # more programs resident per SM, which a walk bound by memory needs
DECODE_PROGRAMS_PER_SM = 4  # split until about this many programs per SM
PREFILL_BLOCK_M = 64
PREFILL_BLOCK_N = 64
PREFILL_NUM_WARPS = 4
PREFILL_NUM_STAGES = 2
# q tiles of at most 16 queries: few programs walk the context, so wider key tiles and a
# deeper pipeline pay (scripts/sweep_verify_attention.py)
SHORT_Q_TILE = 16
SHORT_Q_BLOCK_N = 128
SHORT_Q_NUM_STAGES = 3
SHORT_Q_SPLIT_LEN = 256  # a short step's key split: this many positions of the table width


@triton.jit
def _tile_rows(bt_row, pos, valid, head_off, stride_slot, BLOCK_SIZE: tl.constexpr):
    """Element offsets of the head vectors of context positions `pos` (int64)."""
    block = tl.load(bt_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    return (block * BLOCK_SIZE + pos % BLOCK_SIZE) * stride_slot + head_off


@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr,
                   part_out_ptr, part_lse_ptr, counter_ptr, k_new_ptr, v_new_ptr, slot_ptr,
                   qk_scale, tokens_per_split, stride_qb, stride_qh, stride_ob, stride_oh, stride_bt,
                   stride_slot, stride_ch, stride_nb, stride_nh,
                   BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                   SPLIT: tl.constexpr, MAX_SPLITS: tl.constexpr, FUSE_STORE: tl.constexpr,
                   USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = split * tokens_per_split
    hi = tl.minimum(seq_len, lo + tokens_per_split)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq * stride_qb + head * stride_qh + dims).to(tl.float32) * qk_scale
    new_off = seq * stride_nb + head * stride_nh + dims
    o, lse = attend_split(q, k_new_ptr + new_off, v_new_ptr + new_off, slot_ptr + seq, seq_len,
                          lo, hi, k_cache_ptr, v_cache_ptr,
                          block_tables_ptr + seq.to(tl.int64) * stride_bt, head * stride_ch,
                          stride_slot, BLOCK_SIZE, HEAD_DIM, BLOCK_N, FUSE_STORE)
    finish_split(o, lse, out_ptr + seq * stride_ob + head * stride_oh + dims, part_out_ptr,
                 part_lse_ptr, counter_ptr, seq * tl.num_programs(1) + head, split,
                 tl.num_programs(2), SPLIT, HEAD_DIM, MAX_SPLITS)


@triton.jit
def attend_split(q, k_new_ptrs, v_new_ptrs, slot_ptr, seq_len, lo, hi, k_cache_ptr, v_cache_ptr,
                 bt_row, head_off, stride_slot, BLOCK_SIZE: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, FUSE_STORE: tl.constexpr):
    """One query (q [HEAD_DIM] fp32, the scale and log2(e) folded in) over context positions
    [lo, hi) of one (sequence, head): returns (o [HEAD_DIM] fp32, lse), o normalised over the
    range and lse its log2-sum-exp (-inf for an empty range, whose o is zeros). With
    FUSE_STORE the new token's K/V (seq_len - 1) come from k_new_ptrs / v_new_ptrs, and the
    range holding that position stores them at the slot (unless -1), so no program reads a
    slot another writes."""
    dims = tl.arange(0, HEAD_DIM)
    # per-lane state: row j of every tile keeps its own running max / sum / accumulator, so the
    # loop needs no cross-warp reduction; the BLOCK_N lanes are merged once after it
    m_i = tl.full([BLOCK_N], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_N], tl.float32)
    acc = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    last = seq_len - 1  # the new token's position
    if FUSE_STORE:
        k_new = tl.load(k_new_ptrs)
        v_new = tl.load(v_new_ptrs)
        slot = tl.load(slot_ptr).to(tl.int64)
        if (slot >= 0) & (lo <= last) & (last < hi):
            tl.store(k_cache_ptr + slot * stride_slot + head_off + dims, k_new)
            tl.store(v_cache_ptr + slot * stride_slot + head_off + dims, v_new)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        rows = _tile_rows(bt_row, pos, valid, head_off, stride_slot, BLOCK_SIZE)
        if FUSE_STORE:
            cached = valid & (pos != last)
            is_new = (pos == last)[:, None]
            k = tl.load(k_cache_ptr + rows[:, None] + dims[None, :], mask=cached[:, None],
                        other=0.0)
            v = tl.load(v_cache_ptr + rows[:, None] + dims[None, :], mask=cached[:, None],
                        other=0.0)
            k = tl.where(is_new, k_new[None, :], k)
            v = tl.where(is_new, v_new[None, :], v)
        else:
            k = tl.load(k_cache_ptr + rows[:, None] + dims[None, :], mask=valid[:, None],
                        other=0.0)
            v = tl.load(v_cache_ptr + rows[:, None] + dims[None, :], mask=valid[:, None],
                        other=0.0)
        s = tl.where(valid, tl.sum(k.to(tl.float32) * q[None, :], axis=1), float("-inf"))
        m_new = tl.maximum(m_i, s)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # lane still empty: weights 0
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref)
        acc = acc * alpha[:, None] + p[:, None] * v.to(tl.float32)
        l_i = l_i * alpha + p
        m_i = m_new
    m = tl.max(m_i, axis=0)
    w = tl.exp2(m_i - tl.where(m == float("-inf"), 0.0, m))
    l_sum = tl.sum(l_i * w, axis=0)
    l_safe = tl.where(l_sum > 0, l_sum, 1.0)
    o = tl.sum(acc * w[:, None], axis=0) / l_safe  # an empty range (or seq_len 0) gives zeros
    return o, tl.where(l_sum > 0, m + tl.log2(l_safe), float("-inf"))


@triton.jit
def finish_split(o, lse, out_ptrs, part_out_ptr, part_lse_ptr, counter_ptr, pair, split,
                 num_splits, SPLIT: tl.constexpr, HEAD_DIM: tl.constexpr,
                 MAX_SPLITS: tl.constexpr):
    """Without SPLIT, store o at out_ptrs. With it, store split `split`'s partial (o, lse) of
    (sequence, head) pair `pair`; the last of its num_splits to arrive merges them into
    out_ptrs and resets the pair's counter."""
    dims = tl.arange(0, HEAD_DIM)
    if SPLIT:
        tl.store(part_out_ptr + (pair * num_splits + split) * HEAD_DIM + dims, o)
        tl.store(part_lse_ptr + pair * num_splits + split, lse)
        if arrive_last(counter_ptr + pair, num_splits):
            o = _merge_partials(part_out_ptr, part_lse_ptr, pair * num_splits, num_splits,
                                HEAD_DIM, MAX_SPLITS)
            reset_counter(counter_ptr + pair)
            tl.store(out_ptrs, o.to(out_ptrs.dtype.element_ty))
    else:
        tl.store(out_ptrs, o.to(out_ptrs.dtype.element_ty))


@triton.jit
def _merge_partials(part_out_ptr, part_lse_ptr, base, num_splits, HEAD_DIM: tl.constexpr,
                    MAX_SPLITS: tl.constexpr):
    """Combine the splits' partials (o_i, lse_i) of one (seq, head), weighted by 2^lse_i."""
    splits = tl.arange(0, MAX_SPLITS)
    dims = tl.arange(0, HEAD_DIM)
    lse = tl.load(part_lse_ptr + base + splits, mask=splits < num_splits, other=float("-inf"),
                  cache_modifier=".cg")
    m = tl.max(lse, axis=0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    o = tl.load(part_out_ptr + (base + splits)[:, None] * HEAD_DIM + dims[None, :],
                mask=(splits < num_splits)[:, None], other=0.0, cache_modifier=".cg")
    total = tl.sum(w, axis=0)
    return tl.sum(w[:, None] * o, axis=0) / tl.where(total > 0, total, 1.0)


def num_kv_splits(num_seqs: int, num_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Enough splits for about DECODE_PROGRAMS_PER_SM programs per SM, at least one tile each.
    A full batch (num_seqs * num_heads >= that) gets 1: no partials, no merge."""
    want = triton.cdiv(DECODE_PROGRAMS_PER_SM * num_sms, max(num_seqs * num_heads, 1))
    return max(1, min(want, triton.cdiv(max_seq_len, DECODE_BLOCK_N)))


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None,
                           max_seq_len: int | None = None,
                           new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                           ) -> torch.Tensor:
    """q: [B, H, D], one query per sequence, attending to its seq_lens[b] cached tokens.
    Without new_kv the token's own K/V must already be stored; with new_kv = (k [B, H, D],
    v [B, H, D], slot_mapping [B]) the kernel stores them (slot -1: not) and reads them from
    registers. max_seq_len (a host int) sizes the split grid; default: the table width."""
    num_seqs, num_heads, head_dim = q.shape
    _check_cache(q, k_cache, v_cache)
    block_size = k_cache.shape[1]
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    splits = num_kv_splits(num_seqs, num_heads, max_seq_len, num_sms(q.device))
    tiles_per_split = triton.cdiv(triton.cdiv(max_seq_len, DECODE_BLOCK_N), splits)
    tokens_per_split = tiles_per_split * DECODE_BLOCK_N
    part_out = part_lse = counters = out  # placeholders, unused when splits == 1
    if splits > 1:
        part_out = torch.empty((num_seqs, num_heads, splits, head_dim), dtype=torch.float32,
                               device=q.device)
        part_lse = torch.empty((num_seqs, num_heads, splits), dtype=torch.float32, device=q.device)
        counters = counters_for(q.device, num_seqs * num_heads)
    k_new, v_new, slots = new_kv if new_kv is not None else (q, q, seq_lens)  # unused if None
    assert k_new.stride() == v_new.stride() and k_new.stride(2) == 1
    _decode_kernel[(num_seqs, num_heads, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse, counters, k_new,
        v_new,
        slots, scale * LOG2E, tokens_per_split, q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), block_tables.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_new.stride(0), k_new.stride(1),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_N=DECODE_BLOCK_N, SPLIT=splits > 1,
        MAX_SPLITS=triton.next_power_of_2(splits), FUSE_STORE=new_kv is not None,
        num_warps=DECODE_NUM_WARPS, **pdl_options(q.device))
    return out


@triton.jit
def _attend_tiles(acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row, head_off,
                  stride_slot, lo, hi, valid_end, qk_scale, BLOCK_SIZE: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                  MAY_SEE_NONE: tl.constexpr):
    """Online-softmax update of a q tile's state over the key tiles from lo to hi. Keys at or
    past valid_end are not read; a key of the last tile at or past hi must be past valid_end
    or causally masked. (A mask bound other than the loop's own: on the H100, long prompts
    ran 1.2-1.4x faster with it.) MAY_SEE_NONE: as _online_softmax's, only where a split
    may start past a query's position: the guard cost whole prompts 1.25-1.45x on the H100."""
    dims = tl.arange(0, HEAD_DIM)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < valid_end
        rows = _tile_rows(bt_row, pos, valid, head_off, stride_slot, BLOCK_SIZE)
        k_t = tl.load(k_cache_ptr + rows[None, :] + dims[:, None], mask=valid[None, :], other=0.0)
        s = tl.dot(q, k_t, input_precision="ieee") * qk_scale
        if CAUSAL:
            s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        acc, l_i, m_i, p = _online_softmax(acc, l_i, m_i, s, MAY_SEE_NONE)
        v = tl.load(v_cache_ptr + rows[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
        acc += tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc, l_i, m_i


@triton.jit
def _online_softmax(acc, l_i, m_i, s, MAY_SEE_NONE: tl.constexpr):
    """The state rescaled to s's new row maxima (acc then lacks this tile's p @ v), and the
    tile's weights p. MAY_SEE_NONE: a row may have no visible key yet (a split starting past
    its position), whose weights must be 0, not exp2(-inf - -inf) = NaN."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_ref = m_new
    if MAY_SEE_NONE:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    return acc * alpha[:, None], l_i * alpha + tl.sum(p, axis=1), m_new, p


@triton.jit
def _attend_own_keys(acc, l_i, m_i, q, q_pos, q_start, new_start, seq_len, lo, hi, k_new_ptr,
                     v_new_ptr, slot_ptr, stride_nt, new_head_off, k_cache_ptr, v_cache_ptr,
                     stride_slot, head_off, qk_scale, HEAD_DIM: tl.constexpr,
                     BLOCK_M: tl.constexpr):
    """A short step's tile over its sequence's own new keys (positions new_start .. seq_len,
    tokens q_start onwards) that lie in [lo, hi): read from the step's K/V, causally masked,
    and stored to their slots (none at slot -1) by this program, the one whose split holds
    them."""
    dims = tl.arange(0, HEAD_DIM)
    offs = tl.arange(0, BLOCK_M)
    pos = new_start + offs
    own = (pos < seq_len) & (pos >= lo) & (pos < hi)
    rows = (q_start + offs).to(tl.int64) * stride_nt + new_head_off
    k_t = tl.load(k_new_ptr + rows[None, :] + dims[:, None], mask=own[None, :], other=0.0)
    v = tl.load(v_new_ptr + rows[:, None] + dims[None, :], mask=own[:, None], other=0.0)
    s = tl.dot(q, k_t, input_precision="ieee") * qk_scale
    s = tl.where(own[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
    acc, l_i, m_i, p = _online_softmax(acc, l_i, m_i, s, True)
    acc += tl.dot(p.to(v.dtype), v, input_precision="ieee")
    slot = tl.load(slot_ptr + q_start + offs, mask=own, other=-1).to(tl.int64)
    dst = slot * stride_slot + head_off
    stored = own & (slot >= 0)
    tl.store(k_cache_ptr + dst[None, :] + dims[:, None], k_t, mask=stored[None, :])
    tl.store(v_cache_ptr + dst[:, None] + dims[None, :], v, mask=stored[:, None])
    return acc, l_i, m_i


@triton.jit
def _find_q_tile(tile, query_start_ptr, num_seqs, BLOCK_M: tl.constexpr,
                 SEQS_POW2: tl.constexpr):
    """(sequence, its q tile) of global tile number `tile`; sequence >= num_seqs past the
    last tile."""
    seqs = tl.arange(0, SEQS_POW2)
    real = seqs < num_seqs
    q_lens = (tl.load(query_start_ptr + seqs + 1, mask=real, other=0)
              - tl.load(query_start_ptr + seqs, mask=real, other=0))
    tiles = (q_lens + BLOCK_M - 1) // BLOCK_M
    tiles_end = tl.cumsum(tiles, axis=0)  # past each sequence's last tile
    seq = tl.sum((tiles_end <= tile).to(tl.int32), axis=0)
    first = tl.sum(tl.where(seqs == seq, tiles_end - tiles, 0), axis=0)
    return seq, tile - first


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
                    query_start_ptr, out_ptr, part_out_ptr, part_lse_ptr, counter_ptr, k_new_ptr,
                    v_new_ptr, slot_ptr, qk_scale, num_seqs, tokens_per_split,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_slot, stride_ch,
                    stride_nt, stride_nh,
                    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, SEQS_POW2: tl.constexpr, SPLIT: tl.constexpr,
                    MAX_SPLITS: tl.constexpr, FUSE_STORE: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)  # before the early return: every program waits
    head = tl.program_id(1)
    seq, q_tile = _find_q_tile(tl.program_id(0), query_start_ptr, num_seqs, BLOCK_M, SEQS_POW2)
    if seq >= num_seqs:
        return
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len + q_tile * BLOCK_M  # position of the tile's first query
    offs_m = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    tokens = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=(offs_m < q_len)[:, None], other=0.0)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_off = head * stride_ch
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    q_pos = first_pos + tl.arange(0, BLOCK_M)
    unmasked_end = first_pos // BLOCK_N * BLOCK_N  # keys before it are visible to every query
    lo = 0
    hi = tl.minimum(seq_len, first_pos + BLOCK_M)
    if SPLIT:  # this program's keys: [lo, hi) of its split (tile-aligned)
        lo = tl.program_id(2) * tokens_per_split
        hi = tl.minimum(hi, lo + tokens_per_split)
    if FUSE_STORE:  # a short step: one q tile a sequence, its queries are its new tokens
        # the cached keys end at new_start, mid-tile: the causal mask cuts the tile there
        new_start = seq_len - q_len
        cached_end = tl.minimum(new_start, hi)
        acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr,
                                      bt_row, head_off, stride_slot, lo, cached_end, cached_end,
                                      qk_scale, BLOCK_SIZE, HEAD_DIM, BLOCK_N, True, SPLIT)
        acc, l_i, m_i = _attend_own_keys(acc, l_i, m_i, q, q_pos, q_start, new_start, seq_len,
                                         lo, hi, k_new_ptr, v_new_ptr, slot_ptr, stride_nt,
                                         head * stride_nh, k_cache_ptr, v_cache_ptr,
                                         stride_slot, head_off, qk_scale, HEAD_DIM, BLOCK_M)
    else:
        acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr,
                                      bt_row, head_off, stride_slot, lo,
                                      tl.minimum(unmasked_end, hi), seq_len, qk_scale,
                                      BLOCK_SIZE, HEAD_DIM, BLOCK_N, False, False)
        # without splits a q tile's first key tile holds key 0, which each of its queries sees
        acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr,
                                      bt_row, head_off, stride_slot,
                                      tl.maximum(lo, unmasked_end), hi, seq_len, qk_scale,
                                      BLOCK_SIZE, HEAD_DIM, BLOCK_N, True, SPLIT)
    real = offs_m < q_len
    out_ptrs = out_ptr + tokens[:, None] * stride_ot + head * stride_oh + dims[None, :]
    if SPLIT:
        _store_split_rows(acc, l_i, m_i, tokens, real, head, out_ptrs, part_out_ptr,
                          part_lse_ptr, counter_ptr, HEAD_DIM, MAX_SPLITS)
    else:
        # every query sees key 0, so l_i > 0 on every row (rows past q_len see all keys)
        o = acc / l_i[:, None]
        tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=real[:, None])


@triton.jit
def _store_split_rows(acc, l_i, m_i, tokens, real, head, out_ptrs, part_out_ptr, part_lse_ptr,
                      counter_ptr, HEAD_DIM: tl.constexpr, MAX_SPLITS: tl.constexpr):
    """A split's partial (o, log2-sum-exp) per query row; the last split of the (q tile,
    head) to arrive merges every split's partials into the rows' output, as decode's do
    (a row whose split holds none of its keys has weight 0)."""
    split, num_splits = tl.program_id(2), tl.num_programs(2)
    dims = tl.arange(0, HEAD_DIM)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    base = (tokens * tl.num_programs(1) + head) * num_splits  # [BLOCK_M] partials' rows
    tl.store(part_out_ptr + (base + split)[:, None] * HEAD_DIM + dims[None, :],
             acc / l_safe[:, None], mask=real[:, None])
    tl.store(part_lse_ptr + base + split,
             tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf")), mask=real)
    pair = tl.program_id(0) * tl.num_programs(1) + head
    if arrive_last(counter_ptr + pair, num_splits):
        splits = tl.arange(0, MAX_SPLITS)
        held = real[:, None] & (splits < num_splits)[None, :]
        lse = tl.load(part_lse_ptr + base[:, None] + splits[None, :], mask=held,
                      other=float("-inf"), cache_modifier=".cg")
        m = tl.max(lse, axis=1)
        w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m)[:, None])
        o = tl.load(part_out_ptr + ((base[:, None] + splits[None, :]) * HEAD_DIM)[:, :, None]
                    + dims[None, None, :], mask=held[:, :, None], other=0.0,
                    cache_modifier=".cg")
        total = tl.sum(w, axis=1)
        o = tl.sum(w[:, :, None] * o, axis=1) / tl.where(total > 0, total, 1.0)[:, None]
        reset_counter(counter_ptr + pair)
        tl.store(out_ptrs, o.to(out_ptrs.dtype.element_ty), mask=real[:, None])


def paged_attention_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            query_start_loc: torch.Tensor, max_query_len: int,
                            scale: float,
                            new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                            ) -> torch.Tensor:
    """q: [T, H, D], the new tokens of all sequences concatenated (query_start_loc [S+1]);
    each attends causally to its sequence's first seq_lens[s] cached tokens. Rows past
    query_start_loc[S] (padding) are left unwritten; a sequence may have no new tokens.
    max_query_len (a host int, an upper bound) picks the q tile size. Without new_kv the new
    K/V must already be stored; with new_kv = (k [T, H, D], v [T, H, D], slot_mapping [T])
    they are stored here (slot -1: not): by the kernel in a short step, else by store_kv."""
    _check_cache(q, k_cache, v_cache)
    num_seqs = seq_lens.shape[0]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    short = q.shape[0] <= SHORT_Q_TILE  # so at most one q tile a sequence
    if new_kv is not None and not short:
        store_kv(*new_kv[:2], k_cache, v_cache, new_kv[2])
        new_kv = None
    if num_seqs == 0 or max_query_len == 0:  # no new tokens: nothing to store either
        return out
    # short queries (speculative verification) get a small tile; tl.dot needs M >= 16
    block_m = min(PREFILL_BLOCK_M, max(16, triton.next_power_of_2(max_query_len)))
    block_n, stages = ((SHORT_Q_BLOCK_N, SHORT_Q_NUM_STAGES) if block_m <= SHORT_Q_TILE
                       else (PREFILL_BLOCK_N, PREFILL_NUM_STAGES))
    # each sequence wastes at most one partly filled tile; the tile search's width is at
    # least 16, so batches of up to 16 sequences share one compiled variant
    tiles = triton.cdiv(q.shape[0], block_m) + num_seqs
    splits = 1
    if short:
        splits = triton.cdiv(block_tables.shape[1] * k_cache.shape[1], SHORT_Q_SPLIT_LEN)
    part_out = part_lse = counters = out  # placeholders, unused when splits == 1
    if splits > 1:
        part_out = torch.empty((*q.shape[:2], splits, q.shape[2]), dtype=torch.float32,
                               device=q.device)
        part_lse = torch.empty((*q.shape[:2], splits), dtype=torch.float32, device=q.device)
        counters = counters_for(q.device, tiles * q.shape[1])
    k_new, v_new, slots = new_kv if new_kv is not None else (q, q, seq_lens)  # unused if None
    assert k_new.stride() == v_new.stride() and k_new.stride(2) == 1
    assert k_new.dtype == k_cache.dtype
    _prefill_kernel[(tiles, q.shape[1], splits)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, part_out, part_lse,
        counters, k_new, v_new, slots, scale * LOG2E, num_seqs, SHORT_Q_SPLIT_LEN, q.stride(0),
        q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), k_cache.stride(1),
        k_cache.stride(2), k_new.stride(0), k_new.stride(1), BLOCK_SIZE=k_cache.shape[1],
        HEAD_DIM=q.shape[2], BLOCK_M=block_m, BLOCK_N=block_n,
        SEQS_POW2=max(16, triton.next_power_of_2(num_seqs)), SPLIT=splits > 1,
        MAX_SPLITS=triton.next_power_of_2(splits), FUSE_STORE=new_kv is not None,
        num_warps=PREFILL_NUM_WARPS, num_stages=stages, **pdl_options(q.device))
    return out


def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    head_dim = q.shape[-1]
    assert q.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == q.shape[1:]
    assert head_dim & (head_dim - 1) == 0, "head_dim must be a power of two"
