"""The model's elementwise building blocks as a swappable `Ops`: `TORCH_OPS` is the PyTorch
reference, `triton_ops.triton_ops()` fused kernels with the same signatures. The model gets
one `Ops` at construction (no global switch). A linear's weight is a tensor or, with
quantization on, a `QuantizedWeight`; every `Ops` linear takes either.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class QuantizedWeight:
    """A linear's weight in 8 bits (engine/worker/quantization.py makes them): `data` int8 or
    float8_e4m3fn [out, in] (F.linear's layout), `scale` float32 [out], so that
    weight[n] ~= data[n] * scale[n]. `shape` is the weight's, as a tensor's."""
    data: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.data.float() * self.scale[:, None]).to(dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
               eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (LayerNorm(x + residual), x + residual)."""
    summed = x + residual
    return layer_norm(summed, weight, bias, eps), summed


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (as GPT-2 uses) of x + bias."""
    return F.gelu(x + bias, approximate="tanh")


# From this many rows on, an fp8 weight's linear after the add + LayerNorm (QKV, FC) quantizes
# its activations too, in the LayerNorm kernel, and runs as an fp8 x fp8 GEMM (tensor cores,
# kernels/linear.py); fewer rows stream the weight and keep x 16-bit. 65: up to 64 rows the
# weight-streaming kernel's x tile beat the fp8 GEMM plus the activations' quantization at
# every row count (gpt2-xl's four linears, 38-47 against 46-54 us); beyond, the streaming
# kernel takes GEMM tiles and the fp8 GEMM wins (docs/quantization.md). The other linears
# (O, the MLP's projection) would need a quantization kernel of their own: from 65 rows their
# weight is dequantized for a 16-bit GEMM instead, as every int8 one is.
FP8_GEMM_MIN_ROWS = 65
FP8_MAX = 448.0  # e4m3's largest finite value
FP8_MIN_AMAX = 1e-12  # a row of zeros gets this amax: a finite scale, and its values stay 0


def uses_fp8_gemm(rows: int, weight: torch.Tensor | QuantizedWeight) -> bool:
    """Whether `rows` rows through `weight`, after the add + LayerNorm, take the fp8 x fp8 GEMM
    (W8A8, per-row scales)."""
    return (isinstance(weight, QuantizedWeight) and weight.data.dtype == torch.float8_e4m3fn
            and rows >= FP8_GEMM_MIN_ROWS)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q float8_e4m3fn [M, K], scale float32 [M, 1]) with x[m] ~= q[m] * scale[m]:
    a dynamic scale per row (per token), its largest magnitude mapped to FP8_MAX."""
    xf = x.float()
    scale = xf.abs().amax(dim=1, keepdim=True).clamp(min=FP8_MIN_AMAX) / FP8_MAX
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def fp8_gemm_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None
                    ) -> torch.Tensor:
    """x @ weight.T + bias as the fp8 GEMM computes it: both operands e4m3, products summed in
    fp32, then each row's and each channel's scale and the bias, rounded to x's dtype once."""
    q, scale = quantize_rows_fp8(x)
    y = q.float() @ weight.data.float().t() * scale * weight.scale
    return (y if bias is None else y + bias.float()).to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor,
           gelu: bool = False) -> torch.Tensor:
    """x @ weight.T + bias (weight in F.linear's [out, in] layout), then GELU(tanh) if asked.
    A QuantizedWeight is dequantized to x's dtype first (the GPU's kernels do the same from 65
    rows; up to 64 kernels/quant_linear.py's kernel dequantizes in registers instead)."""
    if isinstance(weight, QuantizedWeight):
        weight = weight.dequantize(x.dtype)
    return bias_gelu(F.linear(x, weight), bias) if gelu else F.linear(x, weight, bias)


def add_norm_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                    norm_bias: torch.Tensor, eps: float, weight: torch.Tensor | QuantizedWeight,
                    bias: torch.Tensor, gelu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(LayerNorm(x + residual), weight, bias, gelu), x + residual): the pre-norm
    block entry, one launch in a decode kernel. An fp8 weight at FP8_GEMM_MIN_ROWS rows or
    more quantizes the normed rows too (fp8_gemm_linear)."""
    normed, summed = add_layer_norm(x, residual, norm_weight, norm_bias, eps)
    if uses_fp8_gemm(x.shape[0], weight):
        y = fp8_gemm_linear(normed, weight, bias)
        return (F.gelu(y, approximate="tanh") if gelu else y), summed
    return linear(normed, weight, bias, gelu), summed


# Sampling is a Gumbel-max race: argmax(logits / T + G) draws from softmax(logits / T) when
# each G is Gumbel(0, 1). G is a pure function of (row seed, token id), a counter-based hash
# that a kernel computes in registers exactly as this reference does: no RNG state, no noise
# tensor, and a row's draw depends on its seed alone, never on its batch.
HASH_MULTIPLIERS = (0x21F0AAAD, 0x735A2D97)  # lowbias32 (a well-mixing 32-bit integer hash)
MASK32 = 0xFFFFFFFF


GUMBEL_ROWS_CPU = 8  # rows hashed at a time on the CPU: their int64 temporaries stay in cache


def _mul32_(x: torch.Tensor, c: int) -> None:
    """x = x * c mod 2^32 in place, for int64 x in [0, 2^32): in halves so nothing
    overflows int64."""
    high = x * (c >> 16)
    high &= 0xFFFF
    high <<= 16
    x *= c & 0xFFFF
    x += high
    x &= MASK32


def _mix32_(x: torch.Tensor) -> None:
    """lowbias32 in place, on int64 x in [0, 2^32)."""
    x ^= x >> 16
    _mul32_(x, HASH_MULTIPLIERS[0])
    x ^= x >> 15
    _mul32_(x, HASH_MULTIPLIERS[1])
    x ^= x >> 15


def hashed_uniform(seeds: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """int64 seeds (>= 0) and int64 columns in [0, 2^32), broadcast together -> float32
    uniforms in (0, 1): 23 hashed bits of (seed, column)."""
    bits = cols ^ (seeds & MASK32)  # a fresh tensor: the mixing works in place on it
    _mix32_(bits)
    bits += seeds >> 32
    bits &= MASK32
    _mix32_(bits)
    bits >>= 9
    return (bits.float() + 0.5) * 2.0 ** -23


def gumbel_noise(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B] int64 seeds (>= 0) -> float32 [B, vocab] of Gumbel(0, 1) noise: the uniform u of
    (seed, token id), and G = -log(-log u). On the CPU GUMBEL_ROWS_CPU rows at a time: the
    same values, with the hash's temporaries in cache rather than batch-sized."""
    cols = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    noise = torch.empty(len(seeds), vocab, device=seeds.device, dtype=torch.float32)
    rows = GUMBEL_ROWS_CPU if seeds.device.type == "cpu" else max(len(seeds), 1)
    for start in range(0, len(seeds), rows):
        uniform = hashed_uniform(seeds[start:start + rows, None], cols)
        noise[start:start + rows] = uniform.log_().neg_().log_().neg_()
    return noise


def sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """[B, V] logits, [B] temperatures (as float32), [B] int64 seeds -> int64 [B] tokens (in
    `out` if given): the row's argmax where its temperature is 0 (greedy), else
    argmax(logits / T + Gumbel noise). As torch.argmax, the first index wins ties and NaN
    ranks highest."""
    logits = logits.float()
    temperature = temperature.float()[:, None]
    if not logits.is_cuda and not (temperature > 0).any():  # a free check on the host only
        tokens = logits.argmax(dim=-1)  # all greedy: no noise to hash over the vocabulary
    else:
        noisy = logits / temperature.clamp(min=1e-30) + gumbel_noise(seeds, logits.shape[1])
        tokens = torch.where(temperature > 0, noisy, logits).argmax(dim=-1)
    return tokens if out is None else out.copy_(tokens)


def masked_sample(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor,
                  temperature: torch.Tensor, seeds: torch.Tensor, out: torch.Tensor) -> None:
    """`sample` for rows `rows` (distinct int64 [R]) of `logits` [N, V] over the tokens each
    one's grammar allows (bitmask int32 [R, >= ceil(V / 32)]: bit t % 32 of word t // 32 of
    row r allows token t for rows[r]), at temperature[r] and seeds[r]; writes out[rows[r]]
    (int64 [N]) and leaves the other entries. NaN counts as -inf; a row whose allowed tokens
    are all -inf takes the lowest allowed one, a row that allows nothing token 0."""
    if rows.numel() == 0:
        return
    vocab = logits.shape[1]
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> bits) & 1 == 1).flatten(1)[:, :vocab]
    scores = logits[rows].float()
    temperature = temperature.float()[:, None]
    if logits.is_cuda or (temperature > 0).any():  # the CPU skips the noise of greedy rows
        noisy = scores / temperature.clamp(min=1e-30) + gumbel_noise(seeds, vocab)
        scores = torch.where(temperature > 0, noisy, scores)
    scores = scores.masked_fill(scores.isnan() | ~allowed, float("-inf"))
    best = scores.argmax(dim=-1)
    dead = scores.gather(1, best[:, None]).squeeze(1) == float("-inf")
    first_allowed = allowed.to(torch.uint8).argmax(dim=-1)  # 0 where nothing is allowed
    out[rows] = torch.where(dead, first_allowed, best)


def sanitized(logits: torch.Tensor) -> torch.Tensor:
    """Logits (any float dtype, kept) with NaN and -inf as -inf and +inf as the dtype's largest
    value."""
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max,
                            neginf=float("-inf"))


def sanitized_log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """The float32 log-softmax of `sanitized` logits (any float dtype); a row with nothing
    finite is uniform (its log-softmax is NaN throughout, replaced by -log V). Three
    kernels."""
    return torch.log_softmax(sanitized(logits), -1, dtype=torch.float32).nan_to_num_(
        nan=-math.log(logits.shape[-1]), neginf=float("-inf"))


def token_logprobs(logits: torch.Tensor, rows: torch.Tensor | None, tokens: torch.Tensor,
                   k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each r, of logits row rows[r] (rows None: row r) as a sanitized_log_softmax: the
    logprob of tokens[rows[r]], and the top k logprobs (descending) with their token ids.
    logits [N, V]; rows int64 [R]; tokens int64 [N]. Returns float32 [R], float32 [R, k],
    int64 [R, k]."""
    if rows is not None:
        logits, tokens = logits[rows], tokens[rows]
    logprobs = sanitized_log_softmax(logits)
    top = logprobs.topk(k, dim=-1)
    return logprobs.gather(1, tokens[:, None]).squeeze(1), top.values, top.indices


def prompt_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """token_logprobs of every row at targets (int64 [R]), with each target's rank: how many
    of the row's `sanitized` logits are >= its own (vLLM's rank over the log-softmax, which
    keeps their order; 1 for the likeliest). Returns float32 [R], int64 [R], float32 [R, k],
    int64 [R, k]."""
    finite = sanitized(logits)
    ranks = (finite >= finite.gather(1, targets[:, None])).sum(dim=-1)
    del finite
    token, top_values, top_ids = token_logprobs(logits, None, targets, k)
    return token, ranks, top_values, top_ids


def copy_staged_blocks(storage: torch.Tensor, pairs: torch.Tensor) -> None:
    """Block dst[i] of every cache in `storage` [layers, 2, num_blocks, *block] becomes block
    src[i], for the pairs the device holds: `pairs` int64 [1 + 2P] is the count n, P sources
    and P destinations (i < n). No destination is another pair's source. Reads n on the
    host (kernels/block_copy.py reads it on the device, in a CUDA graph)."""
    count, max_pairs = int(pairs[0]), (pairs.numel() - 1) // 2
    blocks = storage.flatten(0, 1)  # [caches, num_blocks, *block]
    src, dst = pairs[1:1 + count], pairs[1 + max_pairs:1 + max_pairs + count]
    blocks.index_copy_(1, dst, blocks.index_select(1, src))


def gather_tokens(prev: torch.Tensor, own: torch.Tensor, source: torch.Tensor,
                  num_prev: int) -> torch.Tensor:
    """A graph step's input ids: row i is prev[source[i]] where source[i] < num_prev (the
    previous step's draws), else own[source[i] - num_prev] (tokens the host staged)."""
    from_prev = source < num_prev
    return torch.where(from_prev, prev[source.clamp(max=len(prev) - 1)],
                       own[(source - num_prev).clamp(min=0)])


class LinearShape(NamedTuple):
    """A linear layer as `Ops` serves it: weight [n, k]; `norm`: called through
    add_norm_linear (the residual add and LayerNorm fused before it); `gelu`: GELU after."""
    n: int
    k: int
    gelu: bool
    norm: bool


@dataclass(frozen=True)
class Ops:
    layer_norm: Callable[..., torch.Tensor]
    add_layer_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    linear: Callable[..., torch.Tensor]  # linear(x, weight, bias, gelu=False)
    add_norm_linear: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    sample: Callable[..., torch.Tensor]  # sample(logits, temperature, seeds, out=None)
    # masked_sample(logits, rows, bitmask, temperature, seeds, out): draws into out in place
    masked_sample: Callable[..., None]
    # token_logprobs(logits, rows, tokens, k) -> (token logprob, top k logprobs, their ids)
    token_logprobs: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    # prompt_logprobs(logits, targets, k) -> (target logprob, its rank, top k logprobs, ids)
    prompt_logprobs: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
    # copy_staged_blocks(kv storage, device pairs [n, srcs, dsts]): a forked beam's block copies
    copy_staged_blocks: Callable[[torch.Tensor, torch.Tensor], None]
    # gather_tokens(prev, own, source, num_prev) -> a graph step's input ids
    gather_tokens: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]
    # decode_block(block, hidden, residual, kv_cache, meta) -> (hidden, residual): a whole
    # model Block in one launch, for decode steps of at most decode_block_rows rows (0: none;
    # the model then runs its blocks op by op)
    decode_block: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    decode_block_rows: int = 0


TORCH_OPS = Ops(layer_norm=layer_norm, add_layer_norm=add_layer_norm, linear=linear,
                add_norm_linear=add_norm_linear, sample=sample, masked_sample=masked_sample,
                token_logprobs=token_logprobs, prompt_logprobs=prompt_logprobs,
                copy_staged_blocks=copy_staged_blocks, gather_tokens=gather_tokens)
