"""One config source: frozen dataclasses (EngineConfig: model, cache, scheduler, speculative),
validated once at startup; an invalid value raises `ConfigError` naming the field.

`load_config(path, overrides)` reads a `configs/*.yaml` preset (nested by section) and applies
flat command-line overrides; speculation takes vLLM's `speculative_config` dict instead.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DTYPES = ("float32", "float16", "bfloat16", "auto")
DEVICES = ("cpu", "cuda", "auto")
ATTENTION_BACKENDS = ("torch", "triton", "auto")
SCHEDULING_POLICIES = ("fcfs", "priority")
QUANTIZATION_METHODS = ("int8", "fp8")  # vLLM's names; docs/quantization.md
MAX_CONTEXT = 1024  # every GPT-2 size has 1024 learned positions


class ConfigError(ValueError):
    """A config field holds an invalid value; the message names the field."""


def _check(ok: bool, name: str, value: Any, rule: str) -> None:
    if not ok:
        raise ConfigError(f"invalid config: {name}={value!r}: {rule}")


@dataclass(frozen=True)
class ModelConfig:
    model: str = "gpt2"  # HF hub id or local HF directory
    dtype: str = "auto"  # auto: float16 on cuda, float32 on cpu
    device: str = "auto"  # auto: cuda when available
    attention_backend: str = "auto"  # auto: triton on cuda, torch on cpu
    enforce_eager: bool = False  # turn CUDA graphs off
    mixed_step_graphs: bool = True  # also capture steps with prompt tokens; off: eager
    startup_cache: bool = True  # reuse startup's GPU measurements (engine/worker/startup.py)
    seed: int = 0
    # torch threads of the engine core on CPU; None: the usable cores less one (the API server's)
    num_cpu_threads: int | None = None
    # 8-bit weights of the blocks' linears, quantized at load (int8 or fp8 e4m3, per output
    # channel); None: the checkpoint's weights at `dtype`
    quantization: str | None = None

    def __post_init__(self) -> None:
        _check(bool(self.model), "model", self.model, "must name a hub id or a directory")
        _check(self.dtype in DTYPES, "dtype", self.dtype, f"one of {DTYPES}")
        _check(self.device in DEVICES, "device", self.device, f"one of {DEVICES}")
        _check(self.attention_backend in ATTENTION_BACKENDS, "attention_backend",
               self.attention_backend, f"one of {ATTENTION_BACKENDS}")
        _check(self.num_cpu_threads is None or (_is_int(self.num_cpu_threads)
               and self.num_cpu_threads >= 1), "num_cpu_threads", self.num_cpu_threads,
               "an integer >= 1, or None (the cores this process may run on)")
        _check(self.quantization is None or self.quantization in QUANTIZATION_METHODS,
               "quantization", self.quantization, f"None or one of {QUANTIZATION_METHODS}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from memory (see gpu_memory_utilization)
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 1 << 30  # pool size on CPU when num_kv_blocks is None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        bs = self.block_size
        _check(isinstance(bs, int) and 1 <= bs <= 1024 and bs & (bs - 1) == 0,
               "block_size", bs, "a power of two in [1, 1024]")
        _check(self.num_kv_blocks is None or (isinstance(self.num_kv_blocks, int)
               and self.num_kv_blocks >= 1), "num_kv_blocks", self.num_kv_blocks, ">= 1 or None")
        _check(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization",
               self.gpu_memory_utilization, "in (0, 1]")
        _check(self.cpu_kv_cache_bytes > 0, "cpu_kv_cache_bytes", self.cpu_kv_cache_bytes, "> 0")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256  # running requests at once
    max_num_batched_tokens: int = 2048  # token budget of one forward pass
    max_model_len: int = MAX_CONTEXT  # prompt + output tokens of one request
    async_scheduling: bool = True  # schedule step N+1 while step N runs; off: wait for each
    scheduling_policy: str = "fcfs"  # vLLM's: fcfs, or priority (lower `priority` first)

    def __post_init__(self) -> None:
        _check(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, ">= 1")
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
               self.max_num_batched_tokens, ">= 1")
        _check(1 <= self.max_model_len <= MAX_CONTEXT, "max_model_len", self.max_model_len,
               f"in [1, {MAX_CONTEXT}]")
        _check(self.scheduling_policy in SCHEDULING_POLICIES, "scheduling_policy",
               self.scheduling_policy, f"one of {SCHEDULING_POLICIES}")


SPECULATIVE_METHODS = ("ngram", "draft_model")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _spec_check(ok: bool, name: str, value: Any, rule: str) -> None:
    _check(ok, f"speculative_config.{name}", value, rule)


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config`: {"method": "ngram", "num_speculative_tokens": 4,
    "prompt_lookup_max": 4, "prompt_lookup_min": 2} or {"model": "gpt2",
    "num_speculative_tokens": 4} (a draft model; the method is then "draft_model")."""
    num_speculative_tokens: int  # k: tokens proposed per step, verified in one target pass
    method: str = "ngram"
    model: str | None = None  # the draft's HF hub id or local directory (draft_model only)
    prompt_lookup_max: int | None = None  # longest n-gram matched (ngram only)
    prompt_lookup_min: int | None = None  # shortest n-gram matched (ngram only)
    # true: on a GPU, speculate only where startup's step times say it pays (switch.py)
    adaptive: bool = True

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        _spec_check(_is_int(k) and k >= 1, "num_speculative_tokens", k, "an integer >= 1")
        _spec_check(isinstance(self.adaptive, bool), "adaptive", self.adaptive, "true or false")
        _spec_check(self.method in SPECULATIVE_METHODS, "method", self.method,
               f"one of {SPECULATIVE_METHODS}")
        if self.method == "draft_model":
            _spec_check(isinstance(self.model, str) and bool(self.model), "model", self.model,
                   "the draft_model method needs a draft model (hub id or directory)")
            for name in ("prompt_lookup_max", "prompt_lookup_min"):
                _spec_check(getattr(self, name) is None, name, getattr(self, name),
                       "only the ngram method uses it")
            return
        _spec_check(self.model is None, "model", self.model, "the ngram method uses no model")
        self._settle_lookup_range()

    def _settle_lookup_range(self) -> None:
        """vLLM's defaults: one bound given sets the other; neither gives [5, 5]."""
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = 5
        low, high = (high if low is None else low), (low if high is None else high)
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)
        for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            _spec_check(_is_int(value) and value >= 1, name, value, "an integer >= 1")
        _spec_check(low <= high, "prompt_lookup_min", low, f"<= prompt_lookup_max ({high})")

    @classmethod
    def from_dict(cls, spec: dict[str, Any]) -> SpeculativeConfig:
        """vLLM's dict form; a "model" without a "method" means a draft model."""
        if not isinstance(spec, dict):
            raise ConfigError(f"invalid config: speculative_config={spec!r}: a dict")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ConfigError(f"unknown speculative_config field(s) {unknown}; "
                              f"known: {sorted(known)}")
        if "num_speculative_tokens" not in spec:
            raise ConfigError("invalid config: speculative_config needs num_speculative_tokens")
        spec = dict(spec)
        spec.setdefault("method", "draft_model" if spec.get("model") else "ngram")
        return cls(**spec)


def _speculative_override(value: Any) -> SpeculativeConfig:
    return value if isinstance(value, SpeculativeConfig) else SpeculativeConfig.from_dict(value)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.speculative is not None:
            k = self.speculative.num_speculative_tokens
            budget = self.scheduler.max_num_batched_tokens
            _spec_check(k + 1 <= budget, "num_speculative_tokens", k,
                   f"k + 1 must fit max_num_batched_tokens ({budget})")

    @property
    def max_drafts(self) -> int:
        """Drafts a sequence may carry in a step: k, or 0 without speculation."""
        return self.speculative.num_speculative_tokens if self.speculative else 0

    @classmethod
    def from_flat(cls, base: EngineConfig | None = None, **overrides: Any) -> EngineConfig:
        """Apply flat overrides (`block_size=32`, `dtype="float16"`) to the section owning each;
        `speculative_config` (vLLM's dict) replaces the speculative section."""
        base = base or cls()
        speculative = overrides.pop("speculative_config", None)
        speculative = base.speculative if speculative is None else _speculative_override(
            speculative)
        sections = {f.name: getattr(base, f.name) for f in dataclasses.fields(cls)
                    if f.name != "speculative"}
        updates: dict[str, dict[str, Any]] = {name: {} for name in sections}
        for key, value in overrides.items():
            if value is None:  # not given on the command line
                continue
            owner = next((s for s, obj in sections.items()
                          if key in {f.name for f in dataclasses.fields(obj)}), None)
            if owner is None:
                raise ConfigError(f"unknown config field {key!r}")
            updates[owner][key] = value
        return cls(**{s: dataclasses.replace(obj, **updates[s]) for s, obj in sections.items()},
                   speculative=speculative)


def _approx_parameters(hf: dict[str, Any]) -> int:
    """GPT-2's weights, biases aside: embeddings, per layer attention (4 d^2) and MLP."""
    d = hf["n_embd"]
    inner = hf.get("n_inner") or 4 * d
    per_layer = 4 * d * d + 2 * d * inner
    return (hf["vocab_size"] + hf["n_positions"]) * d + hf["n_layer"] * per_layer


def check_draft_model(target: dict[str, Any], draft: dict[str, Any]) -> None:
    """Raise ConfigError unless the draft (an HF config.json dict) shares the target's
    vocabulary, reaches its positions and is no larger (equal: tests draft with the target)."""
    _check(draft["vocab_size"] == target["vocab_size"], "speculative_config.model",
           f"vocab_size {draft['vocab_size']}",
           f"the draft's vocabulary must be the target's ({target['vocab_size']})")
    _check(draft["n_positions"] >= target["n_positions"], "speculative_config.model",
           f"n_positions {draft['n_positions']}",
           f"the draft must reach the target's {target['n_positions']} positions")
    draft_size, target_size = _approx_parameters(draft), _approx_parameters(target)
    _check(draft_size <= target_size, "speculative_config.model",
           f"~{draft_size / 1e6:.0f}M parameters",
           f"the draft must not be larger than the target (~{target_size / 1e6:.0f}M)")


def flat_field_names() -> list[str]:
    """Every overridable field name, for the command line."""
    return [f.name for section in (ModelConfig, CacheConfig, SchedulerConfig)
            for f in dataclasses.fields(section)]


def load_config(path: str | Path | None = None, **overrides: Any) -> EngineConfig:
    """Read a YAML preset (sections `model`, `cache`, `scheduler`, and `speculative` holding
    vLLM's speculative_config), then apply flat overrides."""
    base = EngineConfig()
    if path is not None:
        import yaml

        data = yaml.safe_load(Path(path).read_text()) or {}
        unknown = set(data) - {"model", "cache", "scheduler", "speculative"}
        if unknown:
            raise ConfigError(f"unknown config section(s) {sorted(unknown)} in {path}")
        speculative = data.pop("speculative", None)
        flat = {k: v for section in data.values() for k, v in (section or {}).items()}
        base = EngineConfig.from_flat(base, **flat, speculative_config=speculative)
    return EngineConfig.from_flat(base, **overrides)
