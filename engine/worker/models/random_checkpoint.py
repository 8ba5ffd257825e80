"""Random-initialised GPT-2 checkpoints in the hub's layout (config.json + model.safetensors,
"transformer." keys, Conv1D weights [in, out], tied lm_head) at any size, for tests and
benchmarks without downloads. CLI: scripts/make_checkpoint.py.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

ARCHS = {  # name: (n_layer, n_embd, n_head)
    "gpt2": (12, 768, 12),
    "gpt2-medium": (24, 1024, 16),
    "gpt2-large": (36, 1280, 20),
    "gpt2-xl": (48, 1600, 25),
}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
VOCAB_SIZE = 50257
N_POSITIONS = 1024
EOS_TOKEN_ID = 50256
INIT_STD = 0.02  # HF's initializer_range


def _shape(arch: str | None, n_layer: int | None, n_embd: int | None,
           n_head: int | None) -> tuple[int, int, int]:
    """An explicit dimension overrides the named architecture's (default gpt2)."""
    base = ARCHS[arch or "gpt2"]
    return n_layer or base[0], n_embd or base[1], n_head or base[2]


def hf_config(n_layer: int, n_embd: int, n_head: int, dtype: str) -> dict:
    """The config.json fields GPT2Config writes (the rest take transformers' defaults)."""
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": VOCAB_SIZE, "n_positions": N_POSITIONS, "n_layer": n_layer,
            "n_embd": n_embd, "n_head": n_head, "n_inner": None,
            "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
            "initializer_range": INIT_STD, "bos_token_id": EOS_TOKEN_ID,
            "eos_token_id": EOS_TOKEN_ID, "tie_word_embeddings": True,
            "scale_attn_weights": True, "torch_dtype": dtype}


def random_weights(n_layer: int, n_embd: int, seed: int) -> dict[str, torch.Tensor]:
    """HF's GPT-2 initialisation (normal weights, residual projections scaled down by
    sqrt(2 * n_layer)), except that biases and LayerNorm weights get noise instead of 0 and 1:
    a bug in how an engine applies a bias or a norm weight then changes the logits."""
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float = INIT_STD, mean: float = 0.0) -> torch.Tensor:
        return mean + torch.randn(shape, generator=gen) * std

    residual_std = INIT_STD / math.sqrt(2 * n_layer)
    state = {"transformer.wte.weight": normal(VOCAB_SIZE, n_embd),
             "transformer.wpe.weight": normal(N_POSITIONS, n_embd)}
    for i in range(n_layer):
        layer = f"transformer.h.{i}."
        for conv, (fan_in, fan_out) in {"attn.c_attn": (n_embd, 3 * n_embd),
                                        "attn.c_proj": (n_embd, n_embd),
                                        "mlp.c_fc": (n_embd, 4 * n_embd),
                                        "mlp.c_proj": (4 * n_embd, n_embd)}.items():
            std = residual_std if conv.endswith("c_proj") else INIT_STD
            state[layer + conv + ".weight"] = normal(fan_in, fan_out, std=std)  # Conv1D: [in, out]
            state[layer + conv + ".bias"] = normal(fan_out)
        for norm in ("ln_1", "ln_2"):
            state[layer + norm + ".weight"] = normal(n_embd, std=0.1, mean=1.0)
            state[layer + norm + ".bias"] = normal(n_embd)
    state["transformer.ln_f.weight"] = normal(n_embd, std=0.1, mean=1.0)
    state["transformer.ln_f.bias"] = normal(n_embd)
    return state


def make_checkpoint(out_dir: str | Path, arch: str | None = None, n_layer: int | None = None,
                    n_embd: int | None = None, n_head: int | None = None, seed: int = 0,
                    dtype: str = "float32") -> Path:
    """Save a seeded random GPT-2 (config.json + model.safetensors) to out_dir; returns it."""
    if arch is not None and arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}: choose one of {sorted(ARCHS)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: choose one of {sorted(DTYPES)}")
    layers, embd, heads = _shape(arch, n_layer, n_embd, n_head)
    if min(layers, embd, heads) < 1 or embd % heads:
        raise ValueError(f"n_layer={layers}, n_embd={embd}, n_head={heads}: all must be >= 1 "
                         f"and n_embd divisible by n_head")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.to(DTYPES[dtype]).contiguous()
             for name, tensor in random_weights(layers, embd, seed).items()}
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(layers, embd, heads, dtype),
                                                indent=2) + "\n")
    return out
