"""Runs one scheduled step: SchedulerOutput ─▶ device inputs ─▶ forward ─▶ logits ─▶ sample.

Owns the model, the paged KV cache and the sampler. Reads the SchedulerOutput only; inputs are
built on the host with numpy and copied to the device once per tensor, and the sampled tokens
come back with one host sync per step.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from engine.worker.attention import get_attention_backend
from engine.core.batch import RunnerOutput, ScheduledSequence, SchedulerOutput
from engine.core.config import EngineConfig
from engine.spec.switch import StepTimes
from engine.worker.draft_rows import position_rows, verify_drafts
from engine.worker.spec_timing import measure_step_times
from engine.worker.cuda_graphs import DecodeGraphs, MixedGraphs, capture_sizes, mixed_capture_sizes
from engine.worker.inputs import (is_decode_step, prepare_host_inputs, take_placeholders,
                                  to_device)
from engine.worker.device import ops_for, resolve_backend, resolve_device, resolve_dtype
from engine.worker.drafter import Drafter, draft_reserved_bytes, draft_runner_config, find_draft
from engine.worker.models.gpt2 import GPT2Config, KVCache, find_checkpoint, load_gpt2
from engine.core.request import SamplingParams
from engine.worker.sampler import DrawInputs, Sampler, SamplerOutput
from engine.worker.startup import (StartupCache, StartupPhases, default_cache_dir, device_key,
                                   source_hash)

log = logging.getLogger(__name__)

def kv_block_bytes(cfg: GPT2Config, block_size: int, dtype: torch.dtype) -> int:
    """K and V of one block across all layers."""
    return 2 * cfg.n_layer * block_size * cfg.n_head * cfg.head_dim * dtype.itemsize


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        self.attention_backend = resolve_backend(config.model.attention_backend, self.device)
        self.startup = StartupPhases()
        self.startup_cache = StartupCache(default_cache_dir() if config.model.startup_cache
                                          else None)
        start = time.perf_counter()
        model_dir, model_config = find_checkpoint(config.model.model)
        draft = find_draft(config, model_dir)  # checked against the target before any load
        table_start = time.perf_counter()
        ops, table_source = ops_for(self.attention_backend, model_config.linear_shapes, config,
                                    self.dtype, self.device, self.startup_cache)
        table_seconds = time.perf_counter() - table_start
        self.model = load_gpt2(model_dir, model_config, self.dtype, self.device, ops,
                               get_attention_backend(self.attention_backend))
        self.startup.add("load", time.perf_counter() - start - table_seconds)
        if table_source is not None:
            self.startup.add("skinny table", table_seconds, table_source)
        self.sampler = Sampler(config.model.seed, self.model.ops.sample)
        log.info("loaded %s (%s, %s, %s attention) with its kernels in %.1f s", model_dir,
                 self.device, self.dtype, self.attention_backend, time.perf_counter() - start)
        # captured once the KV cache exists
        self.decode_graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None
        # the last launched step's sampled tokens, which the next step's placeholders name
        self._last_step: LaunchedStep | None = None
        # the draft model's runner (draft_model method), its pool as large as this one's:
        # set once this pool is sized (engine/worker/drafter.py)
        self.drafter: Drafter | None = None
        self.block_size = config.cache.block_size
        # a step with drafts samples at each draft too: up to k + 1 logits rows a sequence
        spec = config.speculative
        self.max_drafts = spec.num_speculative_tokens if spec else 0
        self.max_sample_rows = config.scheduler.max_num_seqs * (self.max_drafts + 1)
        self.max_blocks_per_seq = -(-config.scheduler.max_model_len // self.block_size)
        start = time.perf_counter()
        self.num_kv_blocks, sizing = ((config.cache.num_kv_blocks, "given")
                                      if config.cache.num_kv_blocks else
                                      self._num_blocks_that_fit(draft))
        self.kv_caches = self._allocate_kv_cache(self.num_kv_blocks)
        self.startup.add("KV sizing", time.perf_counter() - start, sizing)
        if draft is not None:
            self.drafter = Drafter(ModelRunner(draft_runner_config(config, self.num_kv_blocks)))
        log.info("KV cache: %d blocks of %d tokens (%.2f GiB); %.1f requests fit at the full "
                 "%d-token context; sized in %.1f s", self.num_kv_blocks, self.block_size,
                 self.num_kv_blocks * self.kv_block_bytes / 2**30,
                 self.num_kv_blocks / self.max_blocks_per_seq, config.scheduler.max_model_len,
                 time.perf_counter() - start)
        if self._uses_graphs:
            self._capture_graphs()

    @property
    def _uses_graphs(self) -> bool:
        """Graphs need CUDA and a backend whose launches depend on no host values (the torch
        reference loops over sequences on the host)."""
        return (self.device.type == "cuda" and not self.config.model.enforce_eager
                and self.attention_backend == "triton")

    def _capture_graphs(self) -> None:
        """Mixed-step graphs (the larger) first, then decode graphs, in one memory pool;
        with a draft model, each graph runs its forward over the step's inputs too."""
        sched, start, pool = self.config.scheduler, time.perf_counter(), None
        follower = None if self.drafter is None else self.drafter.follow
        if self.config.model.mixed_step_graphs:
            self.mixed_graphs = MixedGraphs(self.model, self.kv_caches,
                                            sched.max_num_batched_tokens, sched.max_num_seqs,
                                            self.max_blocks_per_seq, sched.max_model_len,
                                            self.device, self.max_sample_rows, follower)
            pool = self.mixed_graphs.capture()
        self.decode_graphs = DecodeGraphs(self.model, self.kv_caches, sched.max_num_seqs,
                                   self.max_blocks_per_seq, self.block_size,
                                   sched.max_model_len, self.device, follower)
        self.decode_graphs.capture(pool)
        self.startup.add("graphs", time.perf_counter() - start)
        log.info("captured CUDA graphs in %.1f s: decode for batch sizes %s; mixed steps for "
                 "token counts %s", time.perf_counter() - start, self.decode_graphs.sizes,
                 self.mixed_graphs.sizes if self.mixed_graphs else "none (eager)")

    @property
    def kv_block_bytes(self) -> int:
        return kv_block_bytes(self.model.config, self.block_size, self.dtype)

    def _allocate_kv_cache(self, num_blocks: int) -> list[KVCache]:
        """Zeroed, so never-written slots hold finite values for kernels that load whole blocks."""
        cfg = self.model.config
        shape = (num_blocks, self.block_size, cfg.n_head, cfg.head_dim)
        return [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                 torch.zeros(shape, dtype=self.dtype, device=self.device))
                for _ in range(cfg.n_layer)]

    def _num_blocks_that_fit(self, draft: GPT2Config | None) -> tuple[int, str]:
        """Blocks of this model's pool and, with a draft model, of the draft's beside it; and
        how the budget was found."""
        block_bytes = self.kv_block_bytes
        if draft is not None:
            block_bytes += kv_block_bytes(draft, self.block_size, self.dtype)
        if self.device.type == "cuda":
            budget, sizing = self._profile_free_cuda_bytes()
            if draft is not None:
                budget -= draft_reserved_bytes(draft, self.dtype,
                                               self.config.scheduler.max_num_seqs)
        else:
            budget, sizing = self.config.cache.cpu_kv_cache_bytes, "cpu budget"
        num_blocks = budget // block_bytes
        if num_blocks < 1:
            raise ValueError(f"no memory left for the KV cache: {budget} bytes available, one "
                             f"block needs {block_bytes}")
        return num_blocks, sizing

    def _profile_free_cuda_bytes(self) -> tuple[int, str]:
        """gpu_memory_utilization of the GPU, less what other processes and the CUDA context
        hold and the peak of a worst-case step (weights + activations + sampling); the step's
        bytes above the weights come from the startup cache when an earlier start measured
        them with nothing changed ("cached"), else from running the step ("profiled")."""
        torch.cuda.empty_cache()
        weights = torch.cuda.memory_allocated(self.device)
        step_bytes, cached = self.startup_cache.get_or_measure(
            "worst-step-bytes", self._worst_step_key(), self._worst_step_bytes)
        free, total = torch.cuda.mem_get_info(self.device)
        held_elsewhere = total - free - torch.cuda.memory_reserved(self.device)
        budget = (int(total * self.config.cache.gpu_memory_utilization) - held_elsewhere
                  - weights - step_bytes - self._graph_memory_estimate(step_bytes))
        return budget, "cached" if cached else "profiled"

    def _worst_step_bytes(self) -> int:
        """Peak memory of the worst-case step above what was allocated before it."""
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        step, num_blocks = self._profile_step()
        self._launch(step, self._allocate_kv_cache(num_blocks)).wait()  # a scratch cache
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.empty_cache()
        return peak - before

    def _worst_step_key(self) -> dict:
        """Everything the worst-case step's memory depends on: the device and libraries, the
        model's shapes and dtype, the limits that size the step, and the code that runs it."""
        sched = self.config.scheduler
        return {**device_key(self.device), "model": dataclasses.asdict(self.model.config),
                "dtype": str(self.dtype), "attention_backend": self.attention_backend,
                "block_size": self.block_size, "max_drafts": self.max_drafts,
                "max_num_batched_tokens": sched.max_num_batched_tokens,
                "max_num_seqs": sched.max_num_seqs, "max_model_len": sched.max_model_len,
                "source": source_hash("engine/worker", "kernels")}

    def _graph_memory_estimate(self, step_bytes: int) -> int:
        """Graphs are captured after the cache is allocated, so their pool is set aside up
        front: the logits that every captured size keeps (its outputs live between
        replays), plus the largest step's working memory (`step_bytes`, what the profiled
        worst-case step took above the weights), plus a margin."""
        if not self._uses_graphs:
            return 0
        sched = self.config.scheduler
        rows = sum(capture_sizes(sched.max_num_seqs))
        if self.config.model.mixed_step_graphs:
            rows += sum(min(size, self.max_sample_rows)
                        for size in mixed_capture_sizes(sched.max_num_batched_tokens))
        logits_row = self.model.config.padded_vocab_size * self.dtype.itemsize
        return rows * logits_row + step_bytes + (256 << 20)

    def _profile_step(self) -> tuple[SchedulerOutput, int]:
        """The worst-case step: the full token budget over as many sequences as may run at
        once, each sampling with the sort-based filters (and at up to k drafts, when
        speculating); and the blocks it needs."""
        sched = self.config.scheduler
        num_seqs = min(sched.max_num_seqs, sched.max_num_batched_tokens)
        lens = [min(sched.max_model_len, len(chunk))
                for chunk in np.array_split(np.arange(sched.max_num_batched_tokens), num_seqs)]
        params = SamplingParams(top_k=50, top_p=0.9)
        seqs, next_block = [], 0
        for i, n in enumerate(lens):
            num_blocks = -(-n // self.block_size)
            block_ids = list(range(next_block, next_block + num_blocks))
            seqs.append(ScheduledSequence(f"profile-{i}", [0] * n, 0, block_ids, True, params,
                                          num_drafts=min(n - 1, self.max_drafts)))
            next_block += num_blocks
        num_drafts = sum(s.num_drafts for s in seqs)
        return SchedulerOutput(seqs, num_draft_tokens=num_drafts), next_block

    def measure_spec_step_times(self) -> StepTimes | None:
        """The speculation switch-off's step times (engine/worker/spec_timing.py), on CUDA
        with speculation configured; None elsewhere: CPU times say nothing of a GPU's, and
        without them every step speculates."""
        spec = self.config.speculative
        if spec is None or self.device.type != "cuda":
            return None
        start = time.perf_counter()
        times = measure_step_times(self, spec, self.config.scheduler)
        log.info("speculation cost model measured in %.1f s: %s", time.perf_counter() - start,
                 times)
        return times

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Forward the scheduled tokens, writing their KV, and sample for sample=True
        sequences; waits for the result."""
        return self.launch(out).wait()

    def launch(self, out: SchedulerOutput) -> PendingStep:
        """Queue the step on the device and start copying its tokens back; returns at once.
        Placeholder tokens are read from step `out.step_id - 1`'s sampled tokens on the device,
        the step launched just before."""
        return self._launch(out, self.kv_caches)

    @torch.inference_mode()
    def _launch(self, out: SchedulerOutput, kv_caches: list[KVCache]) -> PendingStep:
        to_sample = [s for s in out.sequences if s.sample]
        rows = position_rows(to_sample) if out.num_draft_tokens else to_sample
        draw_inputs = self.sampler.draw_inputs(rows)
        logits, drawn = self._forward(out, draw_inputs, kv_caches)
        if not to_sample:  # prompt chunks only: nothing to sample
            self._last_step = LaunchedStep(out.step_id, None)
            return PendingStep([], None)
        sampled = self.sampler(logits, rows, draw_inputs, drawn)
        if out.num_draft_tokens:
            sampled = verify_drafts(sampled, to_sample)
        sampled.begin_host_copy()
        self._last_step = LaunchedStep(out.step_id, sampled.token_ids)
        return PendingStep([s.request_id for s in to_sample], sampled)

    def compute_logits(self, out: SchedulerOutput) -> torch.Tensor:
        """Run the forward (writing KV) and return float32 logits [num sample=True seqs, vocab]
        at each sampling sequence's last token. Exposed for tests and scoring."""
        to_sample = [s for s in out.sequences if s.sample]
        with torch.inference_mode():
            draw_inputs = self.sampler.draw_inputs(to_sample)
            return self._forward(out, draw_inputs, self.kv_caches)[0].float()

    def _forward(self, out: SchedulerOutput, draw_inputs: DrawInputs, kv_caches: list[KVCache]
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits of the sampling rows in the model's dtype (`draw_inputs` are theirs), plus
        each one's draw when a graph made it. Graphs run on the cache they captured."""
        if out.is_empty:
            return torch.empty(0, self.model.config.vocab_size, dtype=self.dtype,
                               device=self.device), None
        seqs = out.sequences
        sources = [s.prev_sample_row for s in seqs]
        prev_tokens = self._prev_sampled(out, sources)
        if (self.decode_graphs is not None and len(seqs) <= self.decode_graphs.max_batch
                and is_decode_step(seqs)):
            return self.decode_graphs.run(seqs, sources, prev_tokens, draw_inputs)
        host = prepare_host_inputs(seqs, self.block_size, self.max_blocks_per_seq)
        if self.mixed_graphs is not None and self.mixed_graphs.fits(host):
            return self.mixed_graphs.run(host, sources, prev_tokens, draw_inputs)
        step = to_device(host, self.device)
        if prev_tokens is not None:
            take_placeholders(step, host, sources, prev_tokens)
        hidden = self.model(step.input_ids, step.positions, kv_caches, step.meta)
        if self.drafter is not None:
            self.drafter.follow(step.input_ids, step.positions, step.meta)
        return self.model.lm_head(hidden[step.sample_indices]), None

    def _prev_sampled(self, out: SchedulerOutput, sources: list[int]) -> torch.Tensor | None:
        """The device tokens that `out`'s placeholders (sources >= 0) name: those step
        `out.step_id - 1` sampled, which must be the last launch. None when it has none."""
        if max(sources, default=-1) < 0:
            return None
        last = self._last_step
        if last is None or last.step_id != out.step_id - 1 or last.token_ids is None:
            raise RuntimeError(f"step {out.step_id} has placeholder tokens, but the last launch "
                               f"is not a step {out.step_id - 1} that sampled tokens: {last}")
        return last.token_ids


@dataclass(frozen=True)
class LaunchedStep:
    """A launched step's sampled tokens, still on the device (None: it sampled nothing)."""
    step_id: int
    token_ids: torch.Tensor | None


@dataclass
class PendingStep:
    """A launched step whose sampled tokens are on their way to the host."""
    request_ids: list[str]
    sampled: SamplerOutput | None

    def wait(self) -> RunnerOutput:
        if self.sampled is None:
            return RunnerOutput([], [], [])
        token_ids, logprobs = self.sampled.to_lists()
        return RunnerOutput(self.request_ids, token_ids, logprobs, self.sampled.accepted_list())
