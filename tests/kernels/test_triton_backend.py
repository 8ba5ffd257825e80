"""End to end: the triton backend stores K/V and attends exactly like the torch backend, short
steps (each token a decode row) too."""
import pytest
import torch

from engine.worker.attention import (SHORT_STEP_TOKENS, TorchAttention, get_attention_backend,
                                     per_token_rows)
from kernel_cases import NUM_HEADS, HEAD_DIM, SCALE, make_paged_batch, tol

BATCHES = {
    # a prefill chunk after a cached prefix, a fresh prompt, decodes, then 3 padding tokens
    "mixed": ([20, 9, 1, 1, 1], [57, 9, 100, 1, 333], 3),
    "decode": ([1] * 5, [17, 1, 64, 65, 500], 0),
    # as a mixed-step CUDA graph pads a step: sequences with no new tokens, padding tokens
    "graph-padded": ([20, 1, 1, 0, 0], [57, 100, 1, 0, 0], 8),
}


# steps of at most SHORT_STEP_TOKENS tokens, whose tokens attend as decode rows of their own
SHORT_BATCHES = {
    # verification rows of k + 1 = 5 and 3 tokens beside a decode, then 2 padding tokens
    "verification": ([5, 5, 1, 3], [57, 9, 100, 333], 2),
    "graph-padded": ([4, 1, 1, 0, 0], [57, 100, 1, 0, 0], 8),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", BATCHES)
def test_triton_backend_matches_torch(dtype, kind):
    check_against_torch(*BATCHES[kind], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", SHORT_BATCHES)
def test_short_steps_attend_per_token_like_torch(dtype, kind):
    q_lens, seq_lens, pad = SHORT_BATCHES[kind]
    assert sum(q_lens) + pad <= SHORT_STEP_TOKENS
    positions = [seq_len - q_len + j for q_len, seq_len in zip(q_lens, seq_lens)
                 for j in range(q_len)] + [0] * pad
    check_against_torch(q_lens, seq_lens, pad, dtype, lambda meta: per_token_rows(
        meta, torch.tensor(positions, device=meta.slot_mapping.device)))


def check_against_torch(q_lens, seq_lens, pad, dtype, with_meta=lambda meta: meta):
    """The triton backend's output and cache writes equal the torch backend's over the
    batch's metadata, as `with_meta` extends it."""
    batch = make_paged_batch(q_lens, seq_lens, 16, dtype, pad=pad)
    meta = with_meta(batch.meta)
    valid = batch.meta.slot_mapping[batch.meta.slot_mapping >= 0]
    for cache in (batch.k_cache, batch.v_cache):  # the new tokens' K/V are not cached yet
        cache.view(-1, NUM_HEADS, HEAD_DIM)[valid] = float("nan")
    caches = batch.k_cache.clone(), batch.v_cache.clone()
    backend = get_attention_backend("triton")
    assert backend.name == "triton"
    out = backend.forward(batch.q, batch.k_new, batch.v_new, batch.k_cache, batch.v_cache,
                          meta, SCALE)
    ref = TorchAttention().forward(batch.q, batch.k_new, batch.v_new, *caches, batch.meta, SCALE)
    num_real = sum(q_lens)
    torch.testing.assert_close(out[:num_real], ref[:num_real], **tol(dtype))
    torch.testing.assert_close(batch.k_cache, caches[0], equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(batch.v_cache, caches[1], equal_nan=True, atol=0, rtol=0)
