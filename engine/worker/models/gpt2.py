"""GPT-2 as one flat module over a paged KV cache (gpt-fast style: no HF classes at run time).

Each add + LayerNorm is fused into the linear after it (`ops.add_norm_linear`); the token
embedding enters as the first branch and the position embedding as the first residual:

    hidden, residual = wte[ids], wpe[pos]
    per layer:  qkv, residual = add_ln_1_c_attn(hidden, residual); hidden = c_proj(attn(qkv))
                fc, residual = add_ln_2_c_fc_gelu(hidden, residual); hidden = mlp.c_proj(fc)
    out, _ = add_ln_f(hidden, residual)

A decode step of few rows runs each block in one launch where the ops have one
(`ops.decode_block`, kernels/decode_layer.py), with the same inputs and results.

Weights use F.linear's [out, in] layout (HF's Conv1D stores [in, out]; the loader transposes).
With quantization on, the blocks' four linears are QuantizedLinears (engine/worker/
quantization.py, after the load): their `weight` is a QuantizedWeight, which `ops` takes as it
takes a tensor.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine.worker.attention import AttentionBackend, AttentionMetadata
from engine.worker.layers import LinearShape, Ops
from engine.worker.quantization import QuantizedLinear

KVCache = tuple[torch.Tensor, torch.Tensor]
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
                  "mlp.c_proj.weight")
CAUSAL_MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")  # old HF checkpoints save these
# the tied embedding's rows are zero-padded to a multiple of this: 128-byte aligned logits
# rows keep cuBLAS on its fast kernels
VOCAB_PAD = 64


@dataclass(frozen=True)
class GPT2Config:
    vocab_size: int  # the checkpoint's; the embedding holds padded_vocab_size rows
    n_positions: int
    n_embd: int
    n_layer: int
    n_head: int
    n_inner: int
    layer_norm_epsilon: float

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def padded_vocab_size(self) -> int:
        return -(-self.vocab_size // VOCAB_PAD) * VOCAB_PAD

    @property
    def num_parameters(self) -> int:
        """Weights and biases as loaded (the embedding with its padded rows)."""
        d, inner = self.n_embd, self.n_inner
        per_layer = (3 * d * d + 3 * d) + (d * d + d) + (d * inner + inner) + (inner * d + d)
        return ((self.padded_vocab_size + self.n_positions) * d
                + self.n_layer * (per_layer + 4 * d) + 2 * d)

    @property
    def linear_shapes(self) -> list[LinearShape]:
        """The four linear layers of a block, as `ops` sees them: QKV and FC take the block's
        add + LayerNorm in their prologue (add_norm_linear), FC its GELU."""
        d, inner = self.n_embd, self.n_inner
        return [LinearShape(3 * d, d, gelu=False, norm=True),
                LinearShape(d, d, gelu=False, norm=False),
                LinearShape(inner, d, gelu=True, norm=True),
                LinearShape(d, inner, gelu=False, norm=False)]

    @classmethod
    def from_json(cls, path: Path) -> GPT2Config:
        raw = json.loads(path.read_text())
        kind = raw.get("model_type", "gpt2")
        missing = [key for key in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")
                   if key not in raw]
        if kind != "gpt2" or missing:
            found = f"model_type {kind!r}" if kind != "gpt2" else f"no {', '.join(missing)}"
            raise ValueError(f"{path}: not a GPT-2 checkpoint ({found}); gpt2-serve serves "
                             "GPT-2 models (gpt2, gpt2-medium, gpt2-large, gpt2-xl)")
        if raw.get("scale_attn_by_inverse_layer_idx") or raw.get("reorder_and_upcast_attn"):
            raise ValueError(f"{path}: scale_attn_by_inverse_layer_idx and "
                             "reorder_and_upcast_attn are not supported")
        return cls(vocab_size=raw["vocab_size"], n_positions=raw["n_positions"],
                   n_embd=raw["n_embd"], n_layer=raw["n_layer"], n_head=raw["n_head"],
                   n_inner=raw.get("n_inner") or 4 * raw["n_embd"],
                   layer_norm_epsilon=raw.get("layer_norm_epsilon", 1e-5))


class Attention(nn.Module):
    def __init__(self, cfg: GPT2Config, ops: Ops, backend: AttentionBackend):
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ops = ops
        self.backend = backend
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        self.scale = 1.0 / math.sqrt(cfg.head_dim)

    def forward(self, qkv: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """qkv: the c_attn output [T, 3 * n_embd] (computed by the block, fused with its norm)."""
        num_tokens, n_embd = qkv.shape[0], qkv.shape[1] // 3
        q, k, v = (t.view(num_tokens, self.n_head, self.head_dim)
                   for t in qkv.split(n_embd, dim=-1))
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, scale=self.scale)
        return self.ops.linear(out.reshape(num_tokens, n_embd), self.c_proj.weight,
                               self.c_proj.bias)


class MLP(nn.Module):
    def __init__(self, cfg: GPT2Config, ops: Ops):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, cfg.n_inner)
        self.c_proj = nn.Linear(cfg.n_inner, cfg.n_embd)
        self.ops = ops

    def forward(self, fc: torch.Tensor) -> torch.Tensor:
        """fc: GELU(c_fc(x)) (computed by the block, fused with its norm)."""
        return self.ops.linear(fc, self.c_proj.weight, self.c_proj.bias)


class Block(nn.Module):
    def __init__(self, cfg: GPT2Config, ops: Ops, backend: AttentionBackend):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = Attention(cfg, ops, backend)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = MLP(cfg, ops)
        self.ops = ops

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Takes the previous branch output and residual; returns this block's MLP output and
        the residual it has not yet been added to."""
        qkv, residual = _add_norm_linear(self.ops, hidden, residual, self.ln_1, self.attn.c_attn)
        hidden = self.attn(qkv, kv_cache, meta)
        fc, residual = _add_norm_linear(self.ops, hidden, residual, self.ln_2, self.mlp.c_fc,
                                        gelu=True)
        return self.mlp(fc), residual


def _add_norm_linear(ops: Ops, x: torch.Tensor, residual: torch.Tensor, norm: nn.LayerNorm,
                     linear: nn.Linear | QuantizedLinear, gelu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    return ops.add_norm_linear(x, residual, norm.weight, norm.bias, norm.eps, linear.weight,
                               linear.bias, gelu)


class GPT2(nn.Module):
    def __init__(self, cfg: GPT2Config, ops: Ops, backend: AttentionBackend):
        super().__init__()
        self.config = cfg
        # given weights skip nn.Embedding's normal_ init, which on meta imports torch._dynamo
        self.wte = nn.Embedding(cfg.padded_vocab_size, cfg.n_embd,
                                _weight=torch.empty(cfg.padded_vocab_size, cfg.n_embd))
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd,
                                _weight=torch.empty(cfg.n_positions, cfg.n_embd))
        self.h = nn.ModuleList(Block(cfg, ops, backend) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.ops = ops

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] -> final-normed hidden states [T, n_embd]."""
        hidden, residual = self.wte(input_ids), self.wpe(positions)
        one_launch = (meta.is_decode_only
                      and input_ids.shape[0] == meta.num_seqs <= self.ops.decode_block_rows)
        for block, kv_cache in zip(self.h, kv_caches, strict=True):
            if one_launch:
                hidden, residual = self.ops.decode_block(block, hidden, residual, kv_cache, meta)
            else:
                hidden, residual = block(hidden, residual, kv_cache, meta)
        ln_f = self.ln_f
        return self.ops.add_layer_norm(hidden, residual, ln_f.weight, ln_f.bias, ln_f.eps)[0]

    def lm_head(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, n_embd] -> logits [N, vocab] in the model's dtype through the tied embedding:
        a view that drops the padding columns, its rows still aligned. `out`: [N,
        padded_vocab_size] to write them into (a graph's static buffer)."""
        if out is None:
            out = F.linear(hidden, self.wte.weight)
        else:
            torch.mm(hidden, self.wte.weight.t(), out=out)
        return out[:, :self.config.vocab_size]


def find_checkpoint(model: str) -> tuple[Path, GPT2Config]:
    """A local HF directory or a hub id -> its directory and config (what load_gpt2 takes)."""
    model_dir = resolve_model_dir(model)
    return model_dir, GPT2Config.from_json(model_dir / "config.json")


def load_gpt2(model_dir: Path, cfg: GPT2Config, dtype: torch.dtype, device: torch.device | str,
              ops: Ops, attention: AttentionBackend) -> GPT2:
    """GPT-2 from a checkpoint directory (find_checkpoint), weights cast to dtype on device."""
    with torch.device("meta"):  # no allocation or random init: the checkpoint fills it
        gpt2 = GPT2(cfg, ops, attention)
    state = load_weights(model_dir, dtype, device)
    padding = cfg.padded_vocab_size - cfg.vocab_size
    state["wte.weight"] = F.pad(state["wte.weight"], (0, 0, 0, padding))
    gpt2.load_state_dict(state, strict=True, assign=True)
    return gpt2.eval().requires_grad_(False)


def resolve_model_dir(model: str) -> Path:
    """A local directory as is; anything that is not path-like is a hub id, fetched by
    snapshot_download (which finds it in the HF cache when HF_HUB_OFFLINE=1)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return _check_has_config(path, model)
    if path.is_absolute() or model.startswith((".", "~")) or path.exists():
        raise FileNotFoundError(f"model directory {model!r} does not exist (expected a "
                                f"directory holding config.json and model.safetensors or "
                                f"pytorch_model.bin)")
    return _check_has_config(_download(model), model)


def _download(repo_id: str) -> Path:
    """Fetch only what the loader reads (pytorch_model.bin only without safetensors)."""
    from huggingface_hub import snapshot_download

    try:
        local = Path(snapshot_download(repo_id, allow_patterns=["config.json", "*.safetensors"]))
        if not any(local.glob("*.safetensors")):
            local = Path(snapshot_download(repo_id,
                                           allow_patterns=["config.json", "pytorch_model.bin"]))
    except Exception as err:  # offline, unknown repo, bad id: all mean "no such model here"
        raise FileNotFoundError(
            f"model {repo_id!r} is not a local directory and could not be fetched from the HF "
            f"hub (looked for config.json and *.safetensors or pytorch_model.bin; "
            f"HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '0')}): {err}") from err
    return local


def _check_has_config(path: Path, model: str) -> Path:
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model {model!r}: no config.json in {path}")
    return path


def load_weights(model_dir: Path, dtype: torch.dtype,
                 device: torch.device | str) -> dict[str, torch.Tensor]:
    """Checkpoint tensors under this module's names: "transformer." prefix dropped, causal-mask
    buffers and the tied lm_head skipped, Conv1D weights transposed to [out, in]."""
    state = {}
    for name, tensor in _read_checkpoint(model_dir).items():
        name = name.removeprefix("transformer.")
        if name == "lm_head.weight" or name.endswith(CAUSAL_MASK_BUFFERS):
            continue
        tensor = tensor.to(device=device, dtype=dtype)
        state[name] = tensor.t().contiguous() if name.endswith(CONV1D_WEIGHTS) else tensor
    return state


def _read_checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    shards = sorted(model_dir.glob("*.safetensors"))
    if shards:
        from safetensors.torch import load_file

        return {name: t for shard in shards for name, t in load_file(shard).items()}
    bin_path = model_dir / "pytorch_model.bin"
    if bin_path.is_file():
        return torch.load(bin_path, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"no weights in {model_dir}: expected model.safetensors "
                            f"(or *.safetensors shards) or pytorch_model.bin")
