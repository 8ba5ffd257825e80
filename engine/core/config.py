"""One config source: frozen dataclasses, validated once at startup.

    EngineConfig
      ├── model:     ModelConfig       which checkpoint, dtype, device, attention backend
      ├── cache:     CacheConfig       block size, pool size, prefix caching
      └── scheduler: SchedulerConfig   token budget, sequence cap, context length

Presets live in `configs/*.yaml` (nested by section); `load_config(path, overrides)` merges
command-line overrides (flat field names) on top and validates. An invalid value raises
`ConfigError` naming the field.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DTYPES = ("float32", "float16", "bfloat16", "auto")
DEVICES = ("cpu", "cuda", "auto")
ATTENTION_BACKENDS = ("torch", "triton", "auto")
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
    # also capture steps with prompt tokens (padded token counts); off: they run eagerly
    mixed_step_graphs: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        _check(bool(self.model), "model", self.model, "must name a hub id or a directory")
        _check(self.dtype in DTYPES, "dtype", self.dtype, f"one of {DTYPES}")
        _check(self.device in DEVICES, "device", self.device, f"one of {DEVICES}")
        _check(self.attention_backend in ATTENTION_BACKENDS, "attention_backend",
               self.attention_backend, f"one of {ATTENTION_BACKENDS}")


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
    # schedule step N+1 while step N runs (LLMEngine.step); off: each step is waited for
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        _check(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, ">= 1")
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
               self.max_num_batched_tokens, ">= 1")
        _check(1 <= self.max_model_len <= MAX_CONTEXT, "max_model_len", self.max_model_len,
               f"in [1, {MAX_CONTEXT}]")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    @classmethod
    def from_flat(cls, base: EngineConfig | None = None, **overrides: Any) -> EngineConfig:
        """Apply flat overrides (`block_size=32`, `dtype="float16"`) to the section owning each."""
        base = base or cls()
        sections = {f.name: getattr(base, f.name) for f in dataclasses.fields(cls)}
        updates: dict[str, dict[str, Any]] = {name: {} for name in sections}
        for key, value in overrides.items():
            if value is None:  # not given on the command line
                continue
            owner = next((s for s, obj in sections.items()
                          if key in {f.name for f in dataclasses.fields(obj)}), None)
            if owner is None:
                raise ConfigError(f"unknown config field {key!r}")
            updates[owner][key] = value
        return cls(**{s: dataclasses.replace(obj, **updates[s]) for s, obj in sections.items()})


def flat_field_names() -> list[str]:
    """Every overridable field name, for the command line."""
    return [f.name for section in (ModelConfig, CacheConfig, SchedulerConfig)
            for f in dataclasses.fields(section)]


def load_config(path: str | Path | None = None, **overrides: Any) -> EngineConfig:
    """Read a YAML preset (sections `model`, `cache`, `scheduler`), then apply flat overrides."""
    base = EngineConfig()
    if path is not None:
        import yaml

        data = yaml.safe_load(Path(path).read_text()) or {}
        unknown = set(data) - {"model", "cache", "scheduler"}
        if unknown:
            raise ConfigError(f"unknown config section(s) {sorted(unknown)} in {path}")
        flat = {k: v for section in data.values() for k, v in (section or {}).items()}
        base = EngineConfig.from_flat(base, **flat)
    return EngineConfig.from_flat(base, **overrides)
