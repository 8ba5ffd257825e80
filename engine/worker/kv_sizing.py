"""How many KV-cache blocks fit (when --num-kv-blocks is not given). On CUDA:

    total x gpu_memory_utilization
      - held by other processes and the CUDA context
      - weights                      (allocated before sizing)
      - worst step above the weights (profiled once, then kept in the startup cache)
      - graph pool estimate          (logits of every captured size + one step + margin)
      - reserved_bytes               (a draft model's weights and graphs)
    = budget  ─▶  budget // (bytes of one block + extra_block_bytes: a draft's block)

On CPU the budget is cpu_kv_cache_bytes.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from engine.core.batch import PromptLogprobsJob, ScheduledSequence, SchedulerOutput
from engine.core.config import EngineConfig
from engine.core.request import MAX_LOGPROBS, SamplingParams
from engine.worker.models.gpt2 import GPT2Config
from engine.worker.startup import device_key, source_hash

GRAPH_MARGIN = 256 << 20  # bytes a graph pool estimate adds for what it does not count


def kv_block_bytes(cfg: GPT2Config, block_size: int, dtype: torch.dtype) -> int:
    """K and V of one block across all layers."""
    return 2 * cfg.n_layer * block_size * cfg.n_head * cfg.head_dim * dtype.itemsize


class KVSizing:
    def __init__(self, runner, extra_block_bytes: int = 0, reserved_bytes: int = 0) -> None:
        """runner: the ModelRunner being built (model loaded, no KV cache yet);
        `extra_block_bytes` per block and `reserved_bytes`: a draft model's pool and weights."""
        self.runner, self.config = runner, runner.config
        self.extra_block_bytes, self.reserved_bytes = extra_block_bytes, reserved_bytes

    def num_blocks(self) -> tuple[int, str]:
        """Blocks of the runner's pool, and how the budget was found ("profiled", "cached",
        "cpu budget")."""
        runner = self.runner
        block_bytes = runner.kv_block_bytes + self.extra_block_bytes
        if runner.device.type == "cuda":
            budget, sizing = self.free_cuda_bytes()
            budget -= self.reserved_bytes
        else:
            budget, sizing = self.config.cache.cpu_kv_cache_bytes, "cpu budget"
        num_blocks = budget // block_bytes
        if num_blocks < 1:
            raise ValueError(f"no memory left for the KV cache: {budget} bytes available, one "
                             f"block needs {block_bytes}")
        return num_blocks, sizing

    def free_cuda_bytes(self) -> tuple[int, str]:
        """The module docstring's budget, and "cached" or "profiled" (the worst step's)."""
        device = self.runner.device
        torch.cuda.empty_cache()
        weights = torch.cuda.memory_allocated(device)
        step_bytes, cached = self.runner.startup_cache.get_or_measure(
            "worst-step-bytes", self.worst_step_key(), self.worst_step_bytes)
        free, total = torch.cuda.mem_get_info(device)
        held_elsewhere = total - free - torch.cuda.memory_reserved(device)
        budget = (int(total * self.config.cache.gpu_memory_utilization) - held_elsewhere
                  - weights - step_bytes - self.graph_memory_estimate(step_bytes))
        return budget, "cached" if cached else "profiled"

    def worst_step_bytes(self) -> int:
        """Peak memory of the worst-case step above what was allocated before it."""
        runner = self.runner
        torch.cuda.reset_peak_memory_stats(runner.device)
        before = torch.cuda.memory_allocated(runner.device)
        step, num_blocks = worst_step(self.config, runner.block_size, runner.max_drafts)
        runner.launch_on(step, runner.allocate_kv_cache(num_blocks)).wait()  # a scratch cache
        peak = torch.cuda.max_memory_allocated(runner.device)
        torch.cuda.empty_cache()
        return peak - before

    def worst_step_key(self) -> dict:
        """Everything the worst-case step's memory depends on."""
        runner, sched = self.runner, self.config.scheduler
        return {**device_key(runner.device), "model": dataclasses.asdict(runner.model.config),
                "dtype": str(runner.dtype), "quantization": self.config.model.quantization,
                "attention_backend": runner.attention_backend,
                "block_size": runner.block_size, "max_drafts": runner.max_drafts,
                "max_num_batched_tokens": sched.max_num_batched_tokens,
                "max_num_seqs": sched.max_num_seqs, "max_model_len": sched.max_model_len,
                "source": source_hash("engine/worker", "engine/speculative", "kernels")}

    def graph_memory_estimate(self, step_bytes: int) -> int:
        """The graph pool, set aside before the cache (graphs are captured after it)."""
        runner = self.runner
        if not runner.uses_graphs:
            return 0
        rows = runner.graph_plan.logits_rows()
        logits_row = runner.model.config.padded_vocab_size * runner.dtype.itemsize
        return rows * logits_row + step_bytes + GRAPH_MARGIN


def worst_step(config: EngineConfig, block_size: int,
               max_drafts: int) -> tuple[SchedulerOutput, int]:
    """The worst-case step and the blocks it needs: the full token budget over as many
    sequences as may run, each sampling with sort-based filters at up to k drafts, after
    reporting its other positions' prompt logprobs."""
    sched = config.scheduler
    num_seqs = min(sched.max_num_seqs, sched.max_num_batched_tokens)
    lens = [min(sched.max_model_len, len(chunk))
            for chunk in np.array_split(np.arange(sched.max_num_batched_tokens), num_seqs)]
    params = SamplingParams(top_k=50, top_p=0.9)
    seqs, next_block = [], 0
    for i, n in enumerate(lens):
        num_blocks = -(-n // block_size)
        block_ids = list(range(next_block, next_block + num_blocks))
        job = PromptLogprobsJob(0, (0,) * (n - 1), MAX_LOGPROBS) if n > 1 else None
        seqs.append(ScheduledSequence(f"profile-{i}", [0] * n, 0, block_ids, True, params,
                                      num_drafts=min(n - 1, max_drafts), prompt_logprobs=job))
        next_block += num_blocks
    num_drafts = sum(s.num_drafts for s in seqs)
    return SchedulerOutput(seqs, num_draft_tokens=num_drafts,
                           has_prompt_logprobs=any(s.prompt_logprobs for s in seqs)), next_block
