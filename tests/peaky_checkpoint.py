"""A tiny random GPT-2 whose greedy choices are not near-ties and whose beams often end by
EOS, for beam-search tests that compare rankings across implementations (transformers, the
offline LLM, the server): the token embeddings (tied with the LM head) are scaled up, so the
logits spread, and EOS's logit is raised through ln_f's bias."""
from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file, save_file

from engine.core.request import EOS_TOKEN_ID
from engine.worker.models.random_checkpoint import make_checkpoint

EMBEDDING_SCALE = 3.0
EOS_LOGIT_BOOST = 5.0


def make_peaky_checkpoint(out_dir: Path) -> Path:
    path = make_checkpoint(out_dir, n_layer=2, n_embd=64, n_head=4, seed=0)
    weights = load_file(path / "model.safetensors")
    wte = weights["transformer.wte.weight"] * EMBEDDING_SCALE
    eos = wte[EOS_TOKEN_ID]
    weights["transformer.wte.weight"] = wte
    weights["transformer.ln_f.bias"] = (weights["transformer.ln_f.bias"]
                                        + EOS_LOGIT_BOOST * eos / eos.norm() ** 2)
    save_file(weights, path / "model.safetensors")
    return path
