"""Runs one scheduled step: SchedulerOutput ─▶ device inputs ─▶ forward ─▶ logits ─▶ sample.

Owns the model, the paged KV cache and the sampler. Reads the SchedulerOutput only; inputs are
built on the host with numpy and copied to the device once per tensor, and the sampled tokens
come back with one host sync per step.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from engine.worker.attention import get_attention_backend
from engine.core.batch import RunnerOutput, ScheduledSequence, SchedulerOutput
from engine.core.config import EngineConfig
from engine.speculative.switch import StepTimes
from engine.worker.draft_rows import (draft_token_rows, host_drafts, position_rows,
                                      verify_drafts)
from engine.worker.spec_timing import measure_step_times
from engine.worker.cuda_graphs import DecodeGraphs, MixedGraphs
from engine.worker.cuda_graphs.mixed import WriteDrafts
from engine.worker.inputs import (HostInputs, is_decode_step, prepare_host_inputs,
                                  take_placeholders, to_device, upload)
from engine.worker.device import ops_for, resolve_backend, resolve_device, resolve_dtype
from engine.worker.drafter import Drafter, draft_runner_config, find_draft
from engine.worker.kv_sizing import KVSizing, kv_block_bytes
from engine.worker.models.gpt2 import KVCache, find_checkpoint, load_gpt2
from engine.worker.sampler import DrawInputs, Sampler, SamplerOutput
from engine.worker.startup import StartupCache, StartupPhases, default_cache_dir

log = logging.getLogger(__name__)

class ModelRunner:
    def __init__(self, config: EngineConfig, step_graphs: bool = True):
        """step_graphs False: no CUDA graphs of its own steps, where it would capture them
        (the draft model's runner: the drafter captures its iterations, the target's graphs
        its follow pass)."""
        self.config = config
        self.device = resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        self.attention_backend = resolve_backend(config.model.attention_backend, self.device)
        self.startup = StartupPhases()
        self.startup_cache = StartupCache(default_cache_dir() if config.model.startup_cache
                                          else None)
        if self.device.type == "cuda":  # the context, timed apart from the load
            start = time.perf_counter()
            torch.empty(1, device=self.device)
            self.startup.add("CUDA init", time.perf_counter() - start)
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
                                      KVSizing(self, draft).num_blocks())
        self.kv_caches = self.allocate_kv_cache(self.num_kv_blocks)
        self.startup.add("KV sizing", time.perf_counter() - start, sizing)
        if draft is not None:
            self.drafter = Drafter(ModelRunner(draft_runner_config(config, self.num_kv_blocks),
                                               step_graphs=False), self.max_drafts)
        log.info("KV cache: %d blocks of %d tokens (%.2f GiB); %.1f requests fit at the full "
                 "%d-token context; sized in %.1f s", self.num_kv_blocks, self.block_size,
                 self.num_kv_blocks * self.kv_block_bytes / 2**30,
                 self.num_kv_blocks / self.max_blocks_per_seq, config.scheduler.max_model_len,
                 time.perf_counter() - start)
        if self.uses_graphs and step_graphs:
            self._capture_graphs()

    @property
    def uses_graphs(self) -> bool:
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

    def allocate_kv_cache(self, num_blocks: int) -> list[KVCache]:
        """Zeroed, so never-written slots hold finite values for kernels that load whole blocks."""
        cfg = self.model.config
        shape = (num_blocks, self.block_size, cfg.n_head, cfg.head_dim)
        return [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                 torch.zeros(shape, dtype=self.dtype, device=self.device))
                for _ in range(cfg.n_layer)]

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
        the step launched just before. A step with drafts from the draft model queues the
        draft's iterations first (Drafter.fill); one that verifies every sequence's drafts
        queues the next step's after it (Drafter.draft_ahead)."""
        return self.launch_on(out, self.kv_caches)

    @torch.inference_mode()
    def launch_on(self, out: SchedulerOutput, kv_caches: list[KVCache]) -> PendingStep:
        """launch() into the given caches (KV sizing's worst-case step runs on a scratch
        one)."""
        to_sample = [s for s in out.sequences if s.sample]
        # the draft's follow pass is left out when every sequence verifies drafts
        follow = self.drafter is None or not all(s.num_drafts for s in out.sequences)
        drafts = self._drafts(out, to_sample, not follow)
        rows = position_rows(to_sample) if drafts is not None else to_sample
        draw_inputs = self.sampler.draw_inputs(rows)
        logits, drawn = self._forward(out, draw_inputs, kv_caches,
                                      drafts if self.drafter is not None else None, follow)
        if not to_sample:  # prompt chunks only: nothing to sample
            self._last_step = LaunchedStep(out.step_id, None)
            return PendingStep([], None)
        sampled = self.sampler(logits, rows, draw_inputs, drawn)
        if drafts is not None:
            sampled = verify_drafts(sampled, to_sample, drafts)
        sampled.begin_host_copy()
        if drafts is not None and not follow:  # after the copies: the host waits for those only
            self.drafter.draft_ahead(to_sample, sampled)
        self._last_step = LaunchedStep(out.step_id, sampled.token_ids)
        return PendingStep([s.request_id for s in to_sample], sampled)

    def _drafts(self, out: SchedulerOutput, to_sample: list[ScheduledSequence],
                skips_follow: bool) -> torch.Tensor | None:
        """The step's drafts on the device, [sampling sequences, most drafts], NO_TOKEN past
        a sequence's own: the draft model's, whose iterations are queued now, ahead of the
        target's forward, with no host sync; or the host proposer's. None: no drafts."""
        if not out.num_draft_tokens:
            return None
        if self.drafter is not None:
            return self.drafter.fill(to_sample, skips_follow)
        return host_drafts(to_sample, self.device)

    def compute_logits(self, out: SchedulerOutput) -> torch.Tensor:
        """Run the forward (writing KV) and return float32 logits [num sample=True seqs, vocab]
        at each sampling sequence's last token. Exposed for tests and scoring."""
        to_sample = [s for s in out.sequences if s.sample]
        with torch.inference_mode():
            draw_inputs = self.sampler.draw_inputs(to_sample)
            return self._forward(out, draw_inputs, self.kv_caches)[0].float()

    def _forward(self, out: SchedulerOutput, draw_inputs: DrawInputs, kv_caches: list[KVCache],
                 device_drafts: torch.Tensor | None = None, follow: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits of the sampling rows in the model's dtype (`draw_inputs` are theirs), plus
        each one's draw when a graph made it; `device_drafts` (the draft model's) fill the
        draft slots; the draft model follows unless `follow` is False. Graphs run on the
        cache they captured."""
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
        write_drafts = None if device_drafts is None else self._draft_writer(out, host,
                                                                             device_drafts)
        if self.mixed_graphs is not None and self.mixed_graphs.fits(host):
            return self.mixed_graphs.run(host, sources, prev_tokens, draw_inputs, write_drafts,
                                         follow)
        step = to_device(host, self.device)
        if prev_tokens is not None:
            take_placeholders(step, host, sources, prev_tokens)
        if write_drafts is not None:
            write_drafts(step.input_ids)
        hidden = self.model(step.input_ids, step.positions, kv_caches, step.meta)
        if self.drafter is not None and follow:
            self.drafter.follow(step.input_ids, step.positions, step.meta)
        return self.model.lm_head(hidden[step.sample_indices]), None

    def _draft_writer(self, out: SchedulerOutput, host: HostInputs, drafts: torch.Tensor
                      ) -> WriteDrafts:
        """input_ids -> None: writes `drafts` into the token rows of the draft slots."""
        rows, flat = draft_token_rows([s for s in out.sequences if s.sample],
                                      host.sample_indices, drafts.shape[1])
        rows, flat = (upload(a, torch.int64, self.device) for a in (rows, flat))
        return lambda input_ids: input_ids.index_put_((rows,), drafts.reshape(-1)[flat])

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
        return RunnerOutput(self.request_ids, token_ids, logprobs,
                            self.sampled.accepted_drafts())
