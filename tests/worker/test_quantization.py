"""8-bit weights (quantization="int8" / "fp8") through the CPU reference path: the quantizer,
the model's quantized linears, quality against the same checkpoint unquantized, and the
option through LLM, a draft model, the YAML config and the command line."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.core.config import ConfigError, EngineConfig, ModelConfig, load_config
from engine.worker.attention import AttentionMetadata, TorchAttention
from engine.worker.layers import FP8_GEMM_MIN_ROWS, TORCH_OPS, QuantizedWeight
from engine.worker.models.gpt2 import GPT2, find_checkpoint, load_gpt2
from engine.worker.quantization import (QMAX, STORAGE, QuantizedLinear, check_supported,
                                        quantize_linears, quantize_weight, weight_bytes)
from peaky_checkpoint import make_peaky_checkpoint
from server.__main__ import build_parser, engine_config_from_args

METHODS = ["int8", "fp8"]
MAX_MEAN_KL = 0.01  # nats, next-token distributions, mean over teacher-forced positions
MIN_TOP1_AGREEMENT = 0.97
MIN_GREEDY_EQUAL = 14  # of GREEDY_PROMPTS identical 24-token continuations
GREEDY_PROMPTS = 16
RESIDUAL_PROJECTION_GAIN = 3.0
LOGIT_GAIN = 10.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The peaky checkpoint with blocks that move its logits. As made, its 3x embedding
    dominates the residual stream and the blocks barely matter: a gate on it passes scales on
    the wrong rows. Here the residual projections (attn.c_proj, mlp.c_proj) are 3x larger and
    ln_f's weight 10x (peakier logits), so that such a bug fails the gates
    (test_the_gates_catch_a_broken_quantizer)."""
    path = make_peaky_checkpoint(tmp_path_factory.mktemp("quant-gpt2"))
    weights = load_file(path / "model.safetensors")
    for name in weights:
        if name.endswith("c_proj.weight"):
            weights[name] = weights[name] * RESIDUAL_PROJECTION_GAIN
    weights["transformer.ln_f.weight"] = weights["transformer.ln_f.weight"] * LOGIT_GAIN
    save_file(weights, path / "model.safetensors")
    return path


def load(checkpoint: Path, method: str | None) -> GPT2:
    model = load_gpt2(*find_checkpoint(str(checkpoint)), torch.float32, "cpu", TORCH_OPS,
                      TorchAttention())
    quantize_linears(model, method)
    return model


@torch.inference_mode()
def teacher_forced_logits(model: GPT2, tokens: list[int]) -> torch.Tensor:
    """float32 [len(tokens), vocab]: the next-token logits at every position of one prompt."""
    cfg, n = model.config, len(tokens)
    caches = [(torch.zeros(1, n, cfg.n_head, cfg.head_dim),
               torch.zeros(1, n, cfg.n_head, cfg.head_dim)) for _ in range(cfg.n_layer)]
    meta = AttentionMetadata(torch.arange(n), torch.zeros(1, 1, dtype=torch.int32),
                             torch.tensor([n], dtype=torch.int32),
                             torch.tensor([0, n], dtype=torch.int32), n, n, [0, n], [n])
    hidden = model(torch.tensor(tokens), torch.arange(n), caches, meta)
    return model.lm_head(hidden).float()


def random_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 50256, (length,), generator=gen).tolist() for _ in range(count)]


def gate_figures(reference: GPT2, quantized: GPT2) -> tuple[float, float]:
    """(mean KL(reference || quantized) in nats, top-1 agreement) over the teacher-forced
    positions of 8 random 80-token prompts: FP8_GEMM_MIN_ROWS rows or more, so fp8's figures
    are those of its fp8 GEMM (W8A8) in QKV and FC."""
    kls, agree = [], []
    for prompt in random_prompts(8, 80, seed=1):
        assert len(prompt) >= FP8_GEMM_MIN_ROWS
        ref = teacher_forced_logits(reference, prompt).log_softmax(-1)
        quant = teacher_forced_logits(quantized, prompt).log_softmax(-1)
        kls.append((ref.exp() * (ref - quant)).sum(-1))
        agree.append(ref.argmax(-1) == quant.argmax(-1))
    return torch.cat(kls).mean().item(), torch.cat(agree).float().mean().item()


@pytest.mark.parametrize("method", METHODS)
def test_quantize_weight_is_symmetric_per_output_channel(method):
    weight = torch.randn(6, 40) * torch.tensor([1e-3, 1.0, 30.0, 1.0, 1.0, 1.0])[:, None]
    weight[3] = 0.0
    weight[4, 7] = -50.0  # an outlier sets its row's scale alone
    q = quantize_weight(weight.half(), method)
    assert q.data.dtype == STORAGE[method] and q.scale.dtype == torch.float32
    assert q.shape == (6, 40) and q.scale.shape == (6,)
    amax = weight.half().float().abs().amax(dim=1)
    expected_scale = torch.where(amax > 0, amax / QMAX[method], 1.0)
    torch.testing.assert_close(q.scale, expected_scale, rtol=1e-6, atol=0)
    data = q.data.float()
    assert torch.equal(data.abs().amax(dim=1), torch.tensor([QMAX[method]] * 3 + [0.0]
                                                            + [QMAX[method]] * 2))
    assert data[4, 7] == -QMAX[method]
    error = (q.dequantize(torch.float32) - weight.half().float()).abs()
    if method == "int8":  # rounding: half a step
        assert (error <= q.scale[:, None] * (0.5 + 1e-4)).all()
    else:  # e4m3 keeps 3 mantissa bits: 1/16 of the value, or half its 2^-9 subnormal step
        bound = torch.maximum(weight.half().float().abs() / 16, 2.0 ** -10 * q.scale[:, None])
        assert (error <= bound * (1 + 1e-5)).all()


@pytest.mark.parametrize("method", METHODS)
def test_quantize_linears_swaps_the_four_block_linears(checkpoint, method, caplog):
    model = load(checkpoint, None)
    before = weight_bytes(model)
    biases = [block.attn.c_attn.bias for block in model.h]
    with caplog.at_level(logging.INFO, logger="engine.worker.quantization"):
        quantize_linears(model, method)
    linears = [getattr(getattr(block, parent), name) for block in model.h
               for parent, name in (("attn", "c_attn"), ("attn", "c_proj"), ("mlp", "c_fc"),
                                    ("mlp", "c_proj"))]
    assert all(isinstance(linear, QuantizedLinear) for linear in linears)
    assert all(isinstance(linear.weight, QuantizedWeight) for linear in linears)
    assert all(linear.weight.data.dtype == STORAGE[method] for linear in linears)
    assert [block.attn.c_attn.bias for block in model.h] == biases  # the same parameters
    assert all(p.dtype == torch.float32 for p in model.parameters())  # embedding, norms, biases
    numel = sum(linear.qweight.numel() for linear in linears)
    rows = sum(linear.scale.numel() for linear in linears)
    assert weight_bytes(model) == before - 3 * numel + 4 * rows  # fp32 -> 8 bits, + scales
    assert f"weights {before / 2**20:.1f} MiB -> {weight_bytes(model) / 2**20:.1f} MiB" \
        in caplog.text


@pytest.mark.parametrize("method", METHODS)
def test_quality_gates_against_the_unquantized_checkpoint(checkpoint, method):
    kl, top1 = gate_figures(load(checkpoint, None), load(checkpoint, method))
    print(f"{method}: mean KL {kl:.2e} nats, top-1 agreement {top1:.2%}")
    assert 0.0 < kl <= MAX_MEAN_KL  # above 0: the quantized weights were used
    assert top1 >= MIN_TOP1_AGREEMENT


def test_the_gates_catch_a_broken_quantizer(checkpoint, monkeypatch):
    """Each row's scale applied to another row (the scales reversed) fails both gates."""
    import engine.worker.quantization as quantization

    right = quantization.quantize_weight

    def reversed_scales(weight, method):
        q = right(weight, method)
        return QuantizedWeight(q.data, q.scale.flip(0))

    monkeypatch.setattr(quantization, "quantize_weight", reversed_scales)
    kl, top1 = gate_figures(load(checkpoint, None), load(checkpoint, "int8"))
    assert kl > MAX_MEAN_KL and top1 < MIN_TOP1_AGREEMENT


def make_llm(checkpoint: Path, **overrides) -> LLM:
    return LLM(model=str(checkpoint), device="cpu", dtype="float32", attention_backend="torch",
               num_kv_blocks=256, max_num_seqs=GREEDY_PROMPTS, **overrides)


def greedy_continuations(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate(random_prompts(GREEDY_PROMPTS, 12, seed=2), params, use_tqdm=False)
    return [out.outputs[0].token_ids for out in outputs]


@pytest.fixture(scope="module")
def unquantized_continuations(checkpoint) -> list[list[int]]:
    return greedy_continuations(make_llm(checkpoint))


@pytest.mark.parametrize("method", METHODS)
def test_greedy_continuations_through_llm(checkpoint, unquantized_continuations, method):
    """LLM(quantization=...) end to end on the CPU. Random GPT-2s settle into repeating a
    token or two under greedy decoding, so this gate is weaker than the teacher-forced ones."""
    llm = make_llm(checkpoint, quantization=method)
    assert isinstance(llm.engine.core.runner.model.h[0].mlp.c_fc, QuantizedLinear)
    got = greedy_continuations(llm)
    equal = sum(a == b for a, b in zip(got, unquantized_continuations, strict=True))
    print(f"{method}: {equal} of {GREEDY_PROMPTS} greedy 24-token continuations identical")
    assert equal >= MIN_GREEDY_EQUAL


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels run on CUDA")
@pytest.mark.parametrize("method", METHODS)
def test_cuda_kernels_and_graphs_match_the_reference_ops(checkpoint, method):
    """fp16 on CUDA: the quantized linears' kernel inside decode and mixed-step graphs,
    against the reference ops (eager, torch attention) on the same 8-bit weights."""
    def continuations(**overrides) -> list[list[int]]:
        return greedy_continuations(LLM(model=str(checkpoint), device="cuda", dtype="float16",
                                        quantization=method, num_kv_blocks=256,
                                        max_num_seqs=GREEDY_PROMPTS, **overrides))

    fused = continuations()
    reference = continuations(attention_backend="torch", enforce_eager=True)
    equal = sum(a == b for a, b in zip(fused, reference, strict=True))
    print(f"{method} on CUDA: {equal} of {GREEDY_PROMPTS} continuations match the reference")
    assert equal >= MIN_GREEDY_EQUAL


@pytest.mark.parametrize("method", METHODS)
def test_a_quantized_target_verifies_its_quantized_draft(checkpoint, method):
    """The draft inherits the target's quantization; the target's verification decides every
    token, so greedy output is the quantized target's own: equal. The verification steps (4
    tokens x 16 sequences) stay under FP8_GEMM_MIN_ROWS, so fp8 computes them weight-only as
    it does plain decode steps (its prefills, the same in both runs, are W8A8 in QKV and
    FC)."""
    spec = {"model": str(checkpoint), "num_speculative_tokens": 3}
    llm = make_llm(checkpoint, quantization=method, speculative_config=spec)
    draft = llm.engine.core.runner.speculation.drafter.runner.model
    assert isinstance(draft.h[0].attn.c_attn, QuantizedLinear)
    speculated = greedy_continuations(llm)
    plain = greedy_continuations(make_llm(checkpoint, quantization=method))
    assert speculated == plain


def test_fp8_on_a_gpu_without_e4m3_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"'fp8' needs .* 8.9 .* \(this one: NVIDIA A100\)"):
        check_supported("fp8", torch.device("cuda"))
    check_supported("int8", torch.device("cuda"))
    check_supported("fp8", torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    check_supported("fp8", torch.device("cuda"))


@pytest.mark.parametrize("value", [None, "int8", "fp8"])
def test_config_accepts_vllm_names(value, tmp_path):
    assert ModelConfig(quantization=value).quantization == value
    preset = tmp_path / "preset.yaml"
    preset.write_text(f"model:\n  quantization: {value or 'null'}\n")
    assert load_config(preset).model.quantization == value
    assert EngineConfig.from_flat(quantization=value).model.quantization == value


@pytest.mark.parametrize("value", ["int4", "FP8", "awq", ""])
def test_an_unknown_method_is_a_config_error_naming_the_field(value):
    with pytest.raises(ConfigError, match=f"quantization={value!r}"):
        ModelConfig(quantization=value)


def test_the_quantization_flag(capsys):
    parse = build_parser().parse_args
    assert engine_config_from_args(parse(["--quantization", "fp8"])).model.quantization == "fp8"
    assert engine_config_from_args(parse([])).model.quantization is None
    with pytest.raises(SystemExit):
        parse(["--quantization", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err
