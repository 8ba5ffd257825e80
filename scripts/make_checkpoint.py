"""Write a random-initialised GPT-2 checkpoint in Hugging Face format.

Weights cannot be downloaded where tests and benchmarks run, so they use checkpoints made here:
the same config.json + model.safetensors layout (keys prefixed "transformer.", Conv1D weights
[in, out], lm_head tied to wte) as the real hub checkpoints, at any size.

    python scripts/make_checkpoint.py --arch gpt2-medium --out /tmp/gpt2-medium
    python scripts/make_checkpoint.py --n-layer 2 --n-embd 64 --n-head 4 --out /tmp/tiny
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

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


def _shape(arch: str | None, n_layer: int | None, n_embd: int | None,
           n_head: int | None) -> tuple[int, int, int]:
    """An explicit dimension overrides the named architecture's (default gpt2)."""
    base = ARCHS[arch or "gpt2"]
    return n_layer or base[0], n_embd or base[1], n_head or base[2]


def _perturb_norms_and_biases(model: torch.nn.Module, generator: torch.Generator) -> None:
    """HF initialises biases to 0 and LayerNorm weights to 1; give them noise so that a bug
    in how an engine applies a bias or a norm weight changes the logits and a test sees it."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
            elif ".ln_" in name and name.endswith(".weight"):
                param.copy_(1.0 + torch.randn(param.shape, generator=generator) * 0.1)


def make_checkpoint(out_dir: str | Path, arch: str | None = None, n_layer: int | None = None,
                    n_embd: int | None = None, n_head: int | None = None, seed: int = 0,
                    dtype: str = "float32") -> Path:
    """Save a seeded random GPT2LMHeadModel to out_dir; returns out_dir."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if arch is not None and arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}: choose one of {sorted(ARCHS)}")
    layers, embd, heads = _shape(arch, n_layer, n_embd, n_head)
    if embd % heads:
        raise ValueError(f"n_embd={embd} is not divisible by n_head={heads}")
    config = GPT2Config(vocab_size=VOCAB_SIZE, n_positions=N_POSITIONS, n_layer=layers,
                        n_embd=embd, n_head=heads, bos_token_id=EOS_TOKEN_ID,
                        eos_token_id=EOS_TOKEN_ID)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config).eval()
    _perturb_norms_and_biases(model, torch.Generator().manual_seed(seed))
    out = Path(out_dir)
    model.to(DTYPES[dtype]).save_pretrained(out, safe_serialization=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=sorted(ARCHS), help="named size (default gpt2)")
    parser.add_argument("--n-layer", type=int, help="overrides the arch's layer count")
    parser.add_argument("--n-embd", type=int, help="overrides the arch's hidden size")
    parser.add_argument("--n-head", type=int, help="overrides the arch's head count")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--out", required=True, help="directory to write")
    args = parser.parse_args()
    out = make_checkpoint(args.out, args.arch, args.n_layer, args.n_embd, args.n_head,
                          args.seed, args.dtype)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
