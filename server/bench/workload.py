"""What a benchmark run sends, and when.

Random and shared-prefix prompts are token ids (so their length is exact); a JSONL file holds
one object per line: {"prompt": "text" or [token ids], "output_len": 128 (optional)}.
Each run of a rate sweep gets prompts no other run sent (its own seed, or its own slice of the
file), so no run hits another run's prefix cache.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

EOS_TOKEN_ID = 50256
SEED_STRIDE = 1_000_003  # run i of a sweep draws from seed + i * SEED_STRIDE


@dataclass(frozen=True)
class Prompt:
    prompt: str | list[int]
    output_len: int


class WorkloadError(ValueError):
    """A workload that cannot be built as asked; the message says why."""


def _random_ids(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(EOS_TOKEN_ID) for _ in range(length)]


def random_prompts(count: int, input_len: int, output_len: int, seed: int) -> list[Prompt]:
    rng = random.Random(seed)
    return [Prompt(_random_ids(rng, input_len), output_len) for _ in range(count)]


def shared_prefix_prompts(count: int, input_len: int, output_len: int, prefix_len: int,
                          num_prefixes: int, seed: int) -> list[Prompt]:
    """Request i starts with prefix i % num_prefixes (prefix_len tokens), then its own random
    tokens up to input_len: a system prompt shared by many requests."""
    if not 0 < prefix_len < input_len:
        raise WorkloadError(f"--shared-prefix-len {prefix_len} must be in [1, --input-len "
                            f"{input_len})")
    if num_prefixes < 1:
        raise WorkloadError(f"--num-prefixes {num_prefixes} must be >= 1")
    rng = random.Random(seed)
    prefixes = [_random_ids(rng, prefix_len) for _ in range(num_prefixes)]
    return [Prompt(prefixes[i % num_prefixes] + _random_ids(rng, input_len - prefix_len),
                   output_len) for i in range(count)]


def _parse_line(line: str, where: str, default_output_len: int) -> Prompt:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(item, dict) or "prompt" not in item:
        raise WorkloadError(f'{where}: expected an object with a "prompt" field')
    prompt = item["prompt"]
    token_ids = isinstance(prompt, list) and prompt and all(
        isinstance(t, int) and 0 <= t <= EOS_TOKEN_ID for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not token_ids:
        raise WorkloadError(f'{where}: "prompt" must be a non-empty string or a list of '
                            f"token ids in [0, {EOS_TOKEN_ID}]")
    output_len = item.get("output_len", default_output_len)
    if not isinstance(output_len, int) or output_len < 1:
        raise WorkloadError(f'{where}: "output_len" must be an integer >= 1')
    return Prompt(prompt, output_len)


def jsonl_prompts(path: str | Path, count: int, output_len: int, skip: int = 0) -> list[Prompt]:
    """Lines skip .. skip + count of the file (blank lines do not count)."""
    lines = [(n, line) for n, line in enumerate(Path(path).read_text().splitlines(), 1)
             if line.strip()]
    if len(lines) < skip + count:
        raise WorkloadError(f"{path} holds {len(lines)} prompts; this run needs prompts "
                            f"{skip + 1}..{skip + count} (each rate of a sweep takes its own)")
    return [_parse_line(line, f"{path}:{n}", output_len) for n, line in lines[skip:skip + count]]


def arrival_offsets(count: int, rate: float, seed: int) -> list[float]:
    """Send times in seconds after the start: a Poisson process (exponential gaps of mean
    1/rate) from 0; rate inf sends everything at 0."""
    if rate == float("inf"):
        return [0.0] * count
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=count - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def warmup_prompt(seed: int) -> list[int]:
    """A short prompt no run sends, so the warm-up fills no prefix-cache block a run hits."""
    return _random_ids(random.Random(f"warmup-{seed}"), 8)
