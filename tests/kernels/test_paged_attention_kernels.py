import pytest
import torch

from engine.worker.attention import paged_attention_reference
from kernel_cases import (BLOCK_SIZES, DTYPES, INTERPRET, SCALE, context_lengths, make_paged_batch,
                          tol)
from kernels import paged_attention as pa

DECODE_BATCHES = [1, 9] if INTERPRET else [1, 9, 64, 256]
# (new tokens, context) per sequence: whole prompt, prefix-cache hit on a block boundary, chunk
# from the middle of a prompt, k+1-token speculative verification, one token, several q tiles
PREFILL_MIXED = [(37, 37), (16, 48), (21, 130), (5, 300), (1, 1), (150, 1000)]
PREFILL_VERIFY = [(5, 200), (3, 77), (5, 1024), (1, 9)]
if not INTERPRET:
    PREFILL_MIXED += [(1024, 1024), (512, 1024), (300, 999), (77, 77), (130, 257)]
    PREFILL_VERIFY *= 8


def _decode(batch, max_seq_len):
    out = torch.empty_like(batch.q)  # NaN-poisoned by conftest
    return pa.paged_attention_decode(batch.q, batch.k_cache, batch.v_cache, batch.meta.block_tables,
                                     batch.meta.seq_lens, SCALE, out=out, max_seq_len=max_seq_len)


def _reference(batch):
    return paged_attention_reference(batch.q, batch.k_cache, batch.v_cache, batch.meta, SCALE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("num_seqs", DECODE_BATCHES)
def test_decode(dtype, block_size, num_seqs):
    seq_lens = context_lengths(num_seqs, block_size)
    batch = make_paged_batch([1] * num_seqs, seq_lens, block_size, dtype)
    out = _decode(batch, batch.meta.max_seq_len)
    torch.testing.assert_close(out, _reference(batch), **tol(dtype))


@pytest.mark.parametrize("max_seq_len", [1024, None])
def test_decode_split_grid_wider_than_contexts(max_seq_len):
    """A grid sized for longer contexts than present (as a captured CUDA graph has) leaves some
    splits empty; they must drop out of the merge."""
    batch = make_paged_batch([1] * 3, [1, 40, 99], 16, torch.float32)
    out = _decode(batch, max_seq_len)
    torch.testing.assert_close(out, _reference(batch), **tol(torch.float32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("max_seq_len", [None, 1024])
def test_decode_fused_store(dtype, max_seq_len):
    """With new_kv the kernel stores the new K/V itself (never at slot -1) and attends to them
    from registers: their slots are poisoned first, so a read-before-write shows as NaN."""
    batch = make_paged_batch([1] * 4, [1, 17, 40, 99], 16, dtype)
    expected = _reference(batch)  # the fixture's cache already holds the new K/V
    slots = batch.meta.slot_mapping.clone()
    k_flat, v_flat = (c.view(-1, *c.shape[2:]) for c in (batch.k_cache, batch.v_cache))
    k_flat[slots], v_flat[slots] = float("nan"), float("nan")
    slots[2] = -1  # a padding row: attends, but must not be stored
    out = pa.paged_attention_decode(batch.q, batch.k_cache, batch.v_cache,
                                    batch.meta.block_tables, batch.meta.seq_lens, SCALE,
                                    out=torch.empty_like(batch.q), max_seq_len=max_seq_len,
                                    new_kv=(batch.k_new, batch.v_new, slots))
    torch.testing.assert_close(out, expected, **tol(dtype))
    stored = slots >= 0
    assert torch.equal(k_flat[slots[stored]], batch.k_new[stored])
    assert torch.equal(v_flat[slots[stored]], batch.v_new[stored])
    assert torch.isnan(k_flat[batch.meta.slot_mapping[2]]).all()


def test_decode_empty_context_gives_zeros():
    """Padding rows (seq_len 0, as in a padded CUDA-graph batch) come out as zeros, not NaN."""
    batch = make_paged_batch([1] * 2, [1, 50], 16, torch.float16)
    batch.meta.seq_lens[0] = 0
    assert torch.equal(_decode(batch, 50)[0], torch.zeros_like(batch.q[0]))


def test_num_kv_splits_rule():
    assert pa.num_kv_splits(64, 12, 1024, num_sms=132) == 1  # full batch: no split, no merge
    assert pa.num_kv_splits(1, 12, 1024, num_sms=132) == 1024 // pa.DECODE_BLOCK_N
    assert pa.num_kv_splits(1, 12, 10, num_sms=132) == 1  # never less than one tile per split
    assert 1 < pa.num_kv_splits(8, 12, 1024, num_sms=132) < 1024 // pa.DECODE_BLOCK_N


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("cases", [PREFILL_MIXED, PREFILL_VERIFY], ids=["mixed", "verify"])
def test_prefill(dtype, block_size, cases):
    q_lens, seq_lens = zip(*cases)
    batch = make_paged_batch(list(q_lens), list(seq_lens), block_size, dtype)
    meta = batch.meta
    out = pa.paged_attention_prefill(batch.q, batch.k_cache, batch.v_cache, meta.block_tables,
                                     meta.seq_lens, meta.query_start_loc, meta.max_query_len,
                                     SCALE)
    torch.testing.assert_close(out, _reference(batch), **tol(dtype))


@pytest.mark.parametrize("cases", [[(70, 70)], [(1, 40), (130, 130), (1, 9), (0, 0), (0, 0)]],
                         ids=["one-sequence", "padded"])
def test_prefill_grid_from_shapes(cases):
    """One sequence alone; and a batch padded as a captured CUDA graph pads it: sequences with
    no new tokens and padding token rows after the real ones, which stay unwritten."""
    q_lens, seq_lens = zip(*cases)
    batch = make_paged_batch(list(q_lens), list(seq_lens), 16, torch.float32, pad=37)
    meta = batch.meta
    out = pa.paged_attention_prefill(batch.q, batch.k_cache, batch.v_cache, meta.block_tables,
                                     meta.seq_lens, meta.query_start_loc, 1024, SCALE)
    real = sum(q_lens)
    torch.testing.assert_close(out[:real], _reference(batch)[:real], **tol(torch.float32))
    assert torch.isnan(out[real:]).all()  # torch.empty is NaN-poisoned by conftest


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("contexts", [[1000], [9], [300, 5, 129], [258, 256]],
                         ids=["long", "one-split", "three-rows", "across-a-split"])
def test_prefill_short_step_splits_its_keys(dtype, contexts):
    """A step of at most one short q tile of tokens (a verification as the 16-token graph
    pads it: sequences with no new tokens, padding token rows) splits its keys every
    SHORT_Q_SPLIT_LEN positions of the block tables' width and merges the splits: the rows
    are the reference's, whichever splits hold their keys (a query before a split's first
    key gets nothing from it), and padding stays unwritten."""
    q_lens = [min(5, n) for n in contexts] + [0] * (pa.SHORT_Q_TILE - len(contexts))
    seq_lens = contexts + [0] * (pa.SHORT_Q_TILE - len(contexts))
    pad = pa.SHORT_Q_TILE - sum(q_lens)
    batch = make_paged_batch(q_lens, seq_lens, 16, dtype, pad=pad)
    meta = batch.meta
    width = torch.zeros(len(seq_lens), 1024 // 16, dtype=torch.int32, device=batch.q.device)
    width[:, :meta.block_tables.shape[1]] = meta.block_tables  # a graph's table width
    out = pa.paged_attention_prefill(batch.q, batch.k_cache, batch.v_cache, width,
                                     meta.seq_lens, meta.query_start_loc, pa.SHORT_Q_TILE, SCALE)
    real = sum(q_lens)
    torch.testing.assert_close(out[:real], _reference(batch)[:real], **tol(dtype))
    assert torch.isnan(out[real:]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("contexts", [[300, 5, 129], [256, 258]], ids=["three-rows",
                                                                      "across-a-split"])
def test_prefill_short_step_stores_its_own_kv(dtype, contexts):
    """With new_kv a short step stores its K/V in the kernel (never at slot -1) and attends to
    them from k/v: their slots are poisoned first, so a read-before-write shows as NaN. A
    longer step stores them with store_kv first; both give the reference's rows."""
    q_lens = [min(5, n) for n in contexts]
    batch = make_paged_batch(q_lens, contexts, 16, dtype, pad=pa.SHORT_Q_TILE - sum(q_lens))
    meta = batch.meta
    expected = _reference(batch)  # the fixture's cache already holds the new K/V
    slots = meta.slot_mapping.clone()
    real = sum(q_lens)
    k_flat, v_flat = (c.view(-1, *c.shape[2:]) for c in (batch.k_cache, batch.v_cache))
    k_flat[slots[:real]], v_flat[slots[:real]] = float("nan"), float("nan")
    unstored = slots[1].item()
    slots[1] = -1  # attends from k/v like the others, but must not be stored
    out = pa.paged_attention_prefill(batch.q, batch.k_cache, batch.v_cache, meta.block_tables,
                                     meta.seq_lens, meta.query_start_loc, pa.SHORT_Q_TILE,
                                     SCALE, new_kv=(batch.k_new, batch.v_new, slots))
    torch.testing.assert_close(out[:real], expected[:real], **tol(dtype))
    stored = slots >= 0
    assert torch.equal(k_flat[slots[stored]], batch.k_new[stored])
    assert torch.equal(v_flat[slots[stored]], batch.v_new[stored])
    assert torch.isnan(k_flat[unstored]).all() and torch.isnan(v_flat[unstored]).all()


def test_prefill_long_step_stores_its_kv_first():
    """A step longer than SHORT_Q_TILE with new_kv: stored by store_kv, then attended."""
    batch = make_paged_batch([37, 1], [37, 40], 16, torch.float32)
    meta = batch.meta
    expected = _reference(batch)
    k_flat, v_flat = (c.view(-1, *c.shape[2:]) for c in (batch.k_cache, batch.v_cache))
    k_flat[meta.slot_mapping], v_flat[meta.slot_mapping] = float("nan"), float("nan")
    out = pa.paged_attention_prefill(batch.q, batch.k_cache, batch.v_cache, meta.block_tables,
                                     meta.seq_lens, meta.query_start_loc, meta.max_query_len,
                                     SCALE, new_kv=(batch.k_new, batch.v_new, meta.slot_mapping))
    torch.testing.assert_close(out, expected, **tol(torch.float32))
    assert torch.equal(k_flat[meta.slot_mapping], batch.k_new)
