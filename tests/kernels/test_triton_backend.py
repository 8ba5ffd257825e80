"""End to end: the triton backend stores K/V and attends exactly like the torch backend."""
import pytest
import torch

from engine.worker.attention import TorchAttention, get_attention_backend
from kernel_cases import NUM_HEADS, HEAD_DIM, SCALE, make_paged_batch, tol

BATCHES = {
    # a prefill chunk after a cached prefix, a fresh prompt, decodes, then 3 padding tokens
    "mixed": ([20, 9, 1, 1, 1], [57, 9, 100, 1, 333], 3),
    "decode": ([1] * 5, [17, 1, 64, 65, 500], 0),
    # as a mixed-step CUDA graph pads a step: sequences with no new tokens, padding tokens
    "graph-padded": ([20, 1, 1, 0, 0], [57, 100, 1, 0, 0], 8),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", BATCHES)
def test_triton_backend_matches_torch(dtype, kind):
    q_lens, seq_lens, pad = BATCHES[kind]
    batch = make_paged_batch(q_lens, seq_lens, 16, dtype, pad=pad)
    valid = batch.meta.slot_mapping[batch.meta.slot_mapping >= 0]
    for cache in (batch.k_cache, batch.v_cache):  # the new tokens' K/V are not cached yet
        cache.view(-1, NUM_HEADS, HEAD_DIM)[valid] = float("nan")
    caches = batch.k_cache.clone(), batch.v_cache.clone()
    backend = get_attention_backend("triton")
    assert backend.name == "triton"
    out = backend.forward(batch.q, batch.k_new, batch.v_new, batch.k_cache, batch.v_cache,
                          batch.meta, SCALE)
    ref = TorchAttention().forward(batch.q, batch.k_new, batch.v_new, *caches, batch.meta, SCALE)
    num_real = sum(q_lens)
    torch.testing.assert_close(out[:num_real], ref[:num_real], **tol(dtype))
    torch.testing.assert_close(batch.k_cache, caches[0], equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(batch.v_cache, caches[1], equal_nan=True, atol=0, rtol=0)
