import pytest
import torch

from engine.worker.attention import store_kv_reference
from kernel_cases import BLOCK_SIZES, DEVICE, DTYPES, HEAD_DIM, INTERPRET, NUM_HEADS
from kernels.store_kv import store_kv

NUM_TOKENS = [1, 13] if INTERPRET else [1, 13, 2048]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_store_kv_writes_mapped_slots_only(dtype, block_size, num_tokens):
    num_blocks = num_tokens // block_size + 4
    shape = (num_blocks, block_size, NUM_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device=DEVICE).to(dtype)
    v_cache = torch.randn(shape, device=DEVICE).to(dtype)
    # K and V as views of a fused QKV projection output: token stride 3 * H * D
    qkv = torch.randn(num_tokens, 3, NUM_HEADS, HEAD_DIM, device=DEVICE).to(dtype)
    k, v = qkv[:, 1], qkv[:, 2]
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    slots[torch.rand(num_tokens, device=DEVICE) < 0.3] = -1  # padding, never written
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    store_kv_reference(k, v, expect_k, expect_v, slots)
    store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)
