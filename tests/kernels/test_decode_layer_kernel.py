"""The one-launch decode block (kernels/decode_layer.py) against the block as the model runs it
on the reference ops (engine.worker.models.gpt2.Block over TORCH_OPS and the torch attention):
the block's output, its residual and the K/V it stores, at one and two rows, 16-bit and 8-bit
weights, contexts from one token to several blocks; on CUDA also the barriers' counter left
at zero and a captured graph replayed on new inputs."""
import pytest
import torch

from engine.worker.attention import TorchAttention
from engine.worker.layers import TORCH_OPS
from engine.worker.models.gpt2 import Block, GPT2Config
from engine.worker.quantization import quantize_block
from kernel_cases import DEVICE, HEAD_DIM, INTERPRET, make_paged_batch, replayed_on_new_inputs
from kernels.decode_layer import BlockWeights, DecodeLayerConfig, Linear, PagedKV, decode_layer

NUM_HEADS = 2 if INTERPRET else 25  # gpt2-xl's width on the GPU
CONFIGS = [DecodeLayerConfig(), DecodeLayerConfig(1024, 4, 16)]  # one K step; several


def _block(dtype: torch.dtype, method: str | None) -> Block:
    d = NUM_HEADS * HEAD_DIM
    cfg = GPT2Config(vocab_size=64, n_positions=2048, n_embd=d, n_layer=1, n_head=NUM_HEADS,
                     n_inner=4 * d, layer_norm_epsilon=1e-5)
    block = Block(cfg, TORCH_OPS, TorchAttention())
    for p in block.parameters():  # LayerNorms away from (1, 0), so a wrong norm shows
        p.data.normal_(0.0, 1.0 if p.dim() == 1 else d ** -0.5)
    block = block.to(device=DEVICE, dtype=dtype)
    if method is not None:
        quantize_block(block, method)
    return block


def _weights(block: Block) -> BlockWeights:
    def linear(module):
        w = module.weight
        return Linear(w, None, module.bias) if isinstance(w, torch.Tensor) else Linear(
            w.data, w.scale, module.bias)

    return BlockWeights((block.ln_1.weight, block.ln_1.bias), linear(block.attn.c_attn),
                        linear(block.attn.c_proj), (block.ln_2.weight, block.ln_2.bias),
                        linear(block.mlp.c_fc), linear(block.mlp.c_proj), block.ln_1.eps)


def _run_both(block, seq_lens, dtype, config, block_size=16):
    batch = make_paged_batch([1] * len(seq_lens), seq_lens, block_size, dtype,
                             num_heads=NUM_HEADS)
    m, d = len(seq_lens), NUM_HEADS * HEAD_DIM
    hidden, residual = (torch.randn(m, d, device=DEVICE).to(dtype) for _ in range(2))
    ref_k, ref_v = batch.k_cache.clone(), batch.v_cache.clone()
    expected = block(hidden, residual, (ref_k, ref_v), batch.meta)
    meta = batch.meta
    kv = PagedKV(batch.k_cache, batch.v_cache, meta.block_tables, meta.seq_lens,
                 meta.slot_mapping)
    got = decode_layer(hidden, residual, _weights(block), kv, NUM_HEADS, block.attn.scale,
                       config)
    return got, expected, (batch.k_cache, batch.v_cache), (ref_k, ref_v)


def _tol(dtype, method):
    """Four roundings to dtype between input and output (qkv, attention, o, fc), as in the
    reference, which rounds at the same points but sums in another order."""
    if dtype == torch.float32 and method is None:
        return dict(atol=2e-4, rtol=2e-4)
    return dict(atol=6e-2, rtol=6e-2) if dtype == torch.bfloat16 else dict(atol=3e-2, rtol=3e-2)


# every dtype and weight format on the default config, the other on fp16 and int8
CASES = [(CONFIGS[0], torch.float32, None), (CONFIGS[0], torch.float16, None),
         (CONFIGS[0], torch.bfloat16, None), (CONFIGS[0], torch.float16, "int8"),
         (CONFIGS[0], torch.float16, "fp8"), (CONFIGS[1], torch.float16, None),
         (CONFIGS[1], torch.float16, "int8")]


@pytest.mark.parametrize("config,dtype,method", CASES)
@pytest.mark.parametrize("seq_lens", [[1], [37], [16, 70]])
def test_decode_layer_matches_the_reference_block(config, dtype, method, seq_lens):
    block = _block(dtype, method)
    (out, res), (exp_out, exp_res), caches, ref_caches = _run_both(block, seq_lens, dtype,
                                                                   config)
    torch.testing.assert_close(res, exp_res, **_tol(dtype, method))
    torch.testing.assert_close(out, exp_out, **_tol(dtype, method))
    for cache, ref in zip(caches, ref_caches):  # the new K/V stored where the reference did
        torch.testing.assert_close(cache, ref, equal_nan=True, **_tol(dtype, method))


def _fp16_case(seq_len: int, rows: int):
    """A random fp16 block, one sequence of seq_len tokens decoding, and `rows` rows of
    (hidden, residual)."""
    block = _block(torch.float16, None)
    batch = make_paged_batch([1], [seq_len], 16, torch.float16, num_heads=NUM_HEADS)
    hidden, residual = (torch.randn(rows, NUM_HEADS * HEAD_DIM, device=DEVICE).half()
                        for _ in range(2))
    return block, batch, hidden, residual


def test_a_padding_row_stores_nothing():
    """A graph's padding row (slot -1, no context) leaves the cache as it was; the real row's
    output is unaffected by it."""
    block, batch, hidden, residual = _fp16_case(20, 2)
    meta = batch.meta
    tables = torch.cat([meta.block_tables, torch.zeros_like(meta.block_tables)])
    seq_lens = torch.tensor([20, 0], dtype=torch.int32, device=DEVICE)
    slots = torch.cat([meta.slot_mapping, torch.full_like(meta.slot_mapping, -1)])
    k_before, v_before = batch.k_cache.clone(), batch.v_cache.clone()
    kv = PagedKV(batch.k_cache, batch.v_cache, tables, seq_lens, slots)
    out, _ = decode_layer(hidden, residual, _weights(block), kv, NUM_HEADS, block.attn.scale)
    one, _ = decode_layer(hidden[:1].clone(), residual[:1].clone(), _weights(block),
                          PagedKV(k_before.clone(), v_before.clone(), meta.block_tables,
                                  meta.seq_lens, meta.slot_mapping),
                          NUM_HEADS, block.attn.scale)
    torch.testing.assert_close(out[:1], one, atol=2e-3, rtol=2e-3)
    written = torch.zeros(batch.k_cache.shape[:2], dtype=torch.bool, device=DEVICE)
    written.view(-1)[meta.slot_mapping] = True
    for cache, before in ((batch.k_cache, k_before), (batch.v_cache, v_before)):
        torch.testing.assert_close(cache[~written], before[~written], equal_nan=True, atol=0,
                                   rtol=0)


@pytest.mark.skipif(INTERPRET, reason="the barriers and graphs run on CUDA only")
def test_decode_layer_in_a_graph_replays_on_new_inputs():
    block, batch, hidden, residual = _fp16_case(300, 1)
    meta = batch.meta
    kv = PagedKV(batch.k_cache, batch.v_cache, meta.block_tables, meta.seq_lens,
                 meta.slot_mapping)
    weights = _weights(block)
    out, res = replayed_on_new_inputs(
        lambda: decode_layer(hidden, residual, weights, kv, NUM_HEADS, block.attn.scale),
        [hidden, residual])
    expected_out, expected_res = block(hidden, residual, (batch.k_cache.clone(),
                                                          batch.v_cache.clone()), meta)
    torch.testing.assert_close(res, expected_res, **_tol(torch.float16, None))
    torch.testing.assert_close(out, expected_out, **_tol(torch.float16, None))
