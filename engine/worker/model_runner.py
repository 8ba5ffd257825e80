"""Runs one scheduled step: SchedulerOutput ─▶ device inputs ─▶ forward ─▶ logits ─▶ sample.

Owns the model, the paged KV cache and the sampler; reads the SchedulerOutput only; one host
sync per step. Speculation reaches it through engine/worker/speculation.py (`NO_SPECULATION`
when off); engine/build.py assembles a runner.
"""
from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from engine.core.batch import (DecodeContinuation, GrammarMask, PromptLogprobs, RunnerOutput,
                               ScheduledSequence, SchedulerOutput, StepRows)
from engine.core.config import EngineConfig
from engine.worker.attention import get_attention_backend
from engine.worker.block_copy import allocate_kv_caches, copy_blocks, kv_storage
from engine.worker.cuda_graphs import (BlockCopyGraph, Continued, DecodeGraphs, GraphPlan,
                                       LogprobGraphs, MaskedDrawGraphs, MixedGraphs,
                                       StepOutputs)
from engine.worker.device import ops_for, resolve_backend, resolve_device, resolve_dtype
from engine.worker.inputs import prepare_host_inputs, take_placeholders, to_device
from engine.worker.kv_sizing import kv_block_bytes
from engine.worker.models.gpt2 import GPT2Config, KVCache, load_gpt2
from engine.worker.prompt_logprobs import PromptLogprobsOutput, compute_prompt_logprobs
from engine.worker.quantization import quantize_linears
from engine.worker.sampler import DrawInputs, Sampler, SamplerOutput, is_plain_but_masked
from engine.worker.speculation import NO_SPECULATION, Speculation, StepPlan
from engine.worker.startup import StartupCache, StartupPhases, default_cache_dir

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: Path, model_config: GPT2Config):
        """Load the model and its ops; the KV cache comes next (`allocate`), then graphs
        (`capture_graphs`)."""
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
        ops, table_source = ops_for(self.attention_backend, model_config, config,
                                    self.dtype, self.device, self.startup_cache)
        table_seconds = time.perf_counter() - start
        self.model = load_gpt2(model_dir, model_config, self.dtype, self.device, ops,
                               get_attention_backend(self.attention_backend))
        quantize_linears(self.model, config.model.quantization)
        self.startup.add("load", time.perf_counter() - start - table_seconds)
        if table_source is not None:
            self.startup.add("kernel table", table_seconds, table_source)
        ops = self.model.ops
        self.sampler = Sampler(config.model.seed, ops.sample, ops.masked_sample,
                               ops.token_logprobs)
        log.info("loaded %s (%s, %s, %s attention) with its kernels in %.1f s", model_dir,
                 self.device, self.dtype, self.attention_backend, time.perf_counter() - start)
        self.block_size = config.cache.block_size
        self.max_drafts = config.max_drafts
        self.graph_plan = GraphPlan.of(config)
        self.max_blocks_per_seq = -(-config.scheduler.max_model_len // self.block_size)
        self.num_kv_blocks = 0
        self.kv_caches: list[KVCache] = []
        self.speculation: Speculation = NO_SPECULATION
        self.decode_graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None
        self.block_copy_graph: BlockCopyGraph | None = None
        # the last launched step's sampled tokens, which the next step's placeholders name
        self._last_step: LaunchedStep | None = None
        self._plain_decode: PlainDecode | None = None  # the last step, if a plain decode step
        self._step_rows = StepRows()  # the rows that the next continued step continues

    @property
    def uses_graphs(self) -> bool:
        """Graphs need CUDA and a backend whose launches depend on no host values (the torch
        reference loops over sequences on the host)."""
        return (self.device.type == "cuda" and not self.config.model.enforce_eager
                and self.attention_backend == "triton")

    def allocate(self, num_blocks: int) -> None:
        """The KV cache: num_blocks blocks of block_size tokens in every layer."""
        self.num_kv_blocks = num_blocks
        self.kv_caches = self.allocate_kv_cache(num_blocks)

    def capture_graphs(self) -> None:
        """Mixed-step graphs (the larger) first, then decode graphs, in one memory pool,
        all writing their logits and draws into one StepOutputs; each graph runs the
        speculation's follower over the step's inputs too, if it has one. Then the masked
        draw's, the logprobs' and the block copies' graphs (structured outputs' rows after a
        graph's draw; rows asking for logprobs; forked beams in steps other than decode
        steps, whose graphs make their copies), in a pool of their own."""
        sched, plan, start, pool = self.config.scheduler, self.graph_plan, time.perf_counter(), None
        follower, cfg = self.speculation.follower, self.model.config
        step = StepOutputs(plan.max_sample_rows, cfg.padded_vocab_size, cfg.vocab_size,
                           self.dtype, self.device)
        if plan.mixed_sizes:
            self.mixed_graphs = MixedGraphs(self.model, self.kv_caches, plan.mixed_sizes,
                                            sched.max_num_seqs, self.max_blocks_per_seq,
                                            sched.max_model_len, self.device,
                                            plan.max_sample_rows, follower, step)
            pool = self.mixed_graphs.capture()
        self.decode_graphs = DecodeGraphs(self.model, self.kv_caches, plan.decode_sizes,
                                          self.max_blocks_per_seq, self.block_size,
                                          sched.max_model_len, self.device, follower, step,
                                          self.model.ops.copy_staged_blocks, sched.max_num_seqs,
                                          MaskedDrawGraphs.rows_for(sched.max_num_seqs))
        self.decode_graphs.capture(pool)
        self.sampler.masked_graphs = MaskedDrawGraphs(
            self.model.ops.masked_sample, step, -(-cfg.vocab_size // 32), sched.max_num_seqs,
            self.device, self.decode_graphs.masked_draw_inputs)
        self.sampler.logprob_graphs = LogprobGraphs(self.model.ops.token_logprobs, step,
                                                    self.dtype, sched.max_num_seqs, self.device)
        self.block_copy_graph = BlockCopyGraph(self.model.ops.copy_staged_blocks,
                                               kv_storage(self.kv_caches), sched.max_num_seqs)
        self.block_copy_graph.capture(self.sampler.logprob_graphs.capture(
            self.sampler.masked_graphs.capture()))
        self.startup.add("graphs", time.perf_counter() - start)
        log.info("captured CUDA graphs in %.1f s: decode for batch sizes %s; mixed steps for "
                 "token counts %s", time.perf_counter() - start, self.decode_graphs.sizes,
                 self.mixed_graphs.sizes if self.mixed_graphs else "none (eager)")

    @property
    def kv_block_bytes(self) -> int:
        return kv_block_bytes(self.model.config, self.block_size, self.dtype)

    def allocate_kv_cache(self, num_blocks: int) -> list[KVCache]:
        cfg = self.model.config
        return allocate_kv_caches(cfg.n_layer, (self.block_size, cfg.n_head, cfg.head_dim),
                                  num_blocks, self.dtype, self.device)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Forward the scheduled tokens, writing their KV, and sample for sample=True
        sequences; waits for the result."""
        return self.launch(out).wait()

    def launch(self, out: SchedulerOutput) -> PendingStep:
        """Queue the step on the device and start copying its tokens back; returns at once.
        Placeholder tokens are read from step `out.step_id - 1`'s sampled tokens on the device,
        the step launched just before."""
        return self.launch_on(out, self.kv_caches)

    @torch.inference_mode()
    def launch_on(self, out: SchedulerOutput, kv_caches: list[KVCache]) -> PendingStep:
        """launch() into the given caches (KV sizing's worst-case step runs on a scratch
        one), after the step's block copies (a decode step's graphs make them)."""
        copies = out.block_copies
        if copies and not (self._is_decode_step(out) and self.decode_graphs.takes_copies(copies)):
            self._copy_blocks(kv_caches, copies)
            copies = ()
        if out.continued is not None and self._continues_plain_decode(out, None):
            self._step_rows.skip(out)  # a continuation of the last step, itself continued
            rows, blocks = out.continued, dict(out.continued.new_blocks)
            return self._launch_plain_decode(
                out, continued_rows(rows), rows.request_ids,
                lambda row, table: table + (blocks[row],), copies)
        out = self._step_rows.full(out)
        sources = [s.prev_sample_row for s in out.sequences]
        if self._continues_plain_decode(out, sources):
            seqs = out.sequences
            return self._launch_plain_decode(
                out, np.array(sources, dtype=np.int64), [s.request_id for s in seqs],
                lambda row, table: seqs[row].block_ids, copies)
        to_sample = [s for s in out.sequences if s.sample]
        plan = self.speculation.plan(out, to_sample)
        draw_inputs = self.sampler.draw_inputs(plan.sample_rows)
        decode = self._is_decode_step(out)
        logits, drawn, prompt_logprobs = self._forward(out, sources, decode, draw_inputs,
                                                       kv_caches, plan, copies)
        self._last_step = LaunchedStep(out.step_id, None)
        self._plain_decode = None
        if decode and is_plain_but_masked(to_sample):
            self._plain_decode = PlainDecode.of(out.step_id, to_sample, draw_inputs)
        pending = PendingStep([s.request_id for s in to_sample], None,
                              prompt_logprobs=prompt_logprobs)
        if to_sample:  # else prompt chunks only: nothing to sample
            pending.sample_with = functools.partial(self._sample, out.step_id, logits, plan,
                                                    draw_inputs, drawn)
            pending.constrained_rows = [i for i, s in enumerate(to_sample)
                                        if s.params.structured_outputs]
            if not pending.constrained_rows:
                pending.sample(None)
        return pending

    def _copy_blocks(self, kv_caches: list[KVCache], copies: tuple[tuple[int, int], ...]
                     ) -> None:
        graph = self.block_copy_graph
        if graph is not None and graph.takes(kv_storage(kv_caches), copies):
            graph.run(copies)
        else:
            copy_blocks(kv_caches, copies)

    def _is_decode_step(self, out: SchedulerOutput) -> bool:
        """A step the decode graphs run: one token per row, every row sampling."""
        seqs = out.sequences
        return (self.decode_graphs is not None and 0 < len(seqs) <= self.decode_graphs.max_batch
                and out.num_tokens == len(seqs) and all(s.sample for s in seqs))

    def _continues_plain_decode(self, out: SchedulerOutput, sources: list[int] | None
                                ) -> bool:
        """continues_plain_decode, and nothing else runs beside the graph (a last plain
        decode step means decode graphs)."""
        last = self._plain_decode
        return (last is not None and self.speculation is NO_SPECULATION
                and continues_plain_decode(last, out, sources, self.decode_graphs.max_batch))

    def _launch_plain_decode(self, out: SchedulerOutput, src: np.ndarray,
                             request_ids: list[str],
                             new_table: Callable[[int, tuple[int, ...]], tuple[int, ...]],
                             copies: tuple[tuple[int, int], ...]) -> PendingStep:
        """launch_on for a step that _continues_plain_decode (row i continues row src[i] of
        the last step; `new_table`: Continued's): its draw inputs, staging and constrained
        rows come from the last step's rows by index (PlainDecode.continued,
        DecodeStager.write_continued), not from its rows, and its tokens are the graph's own
        draws, the constrained rows drawn again once their mask is given, their draw's other
        inputs staged with the step's (MaskedDrawGraphs.stage) where the decode graphs hold a
        segment for them. `copies`: block copies left for the graphs to make."""
        plain = self._plain_decode.continued(out.step_id, src)
        draw_inputs = self.sampler.continued_draw_inputs(plain.temperature, plain.seeded,
                                                         plain.seeds, plain.num_outputs)
        rows = np.flatnonzero(plain.constrained)
        masked = self.sampler.masked_graphs
        staged = (len(rows) > 0 and masked is not None
                  and masked.reads(self.decode_graphs.masked_draw_inputs))
        sources = src.tolist()
        logits, drawn = self.decode_graphs.run(
            None, sources, self._prev_sampled(out, sources), draw_inputs,
            continued=Continued(src, new_table), block_copies=copies,
            stage_masked=functools.partial(
                masked.stage, rows=rows, temperature=draw_inputs[0][rows],
                seeds=draw_inputs[1][rows]) if staged else None)
        self._plain_decode = plain
        pending = PendingStep(request_ids, None)
        if len(rows):
            self._last_step = LaunchedStep(out.step_id, None)
            pending.sample_with = functools.partial(
                self._sample_masked_rows, out.step_id, request_ids, rows, logits,
                draw_inputs, drawn, staged)
            pending.constrained_rows = rows.tolist()
            return pending
        pending.sampled = SamplerOutput(drawn, [], [])
        pending.sampled.begin_host_copy()
        self._last_step = LaunchedStep(out.step_id, drawn)
        return pending

    @torch.inference_mode()  # a deferred sample runs after launch_on has returned
    def _sample_masked_rows(self, step_id: int, request_ids: list[str], rows: np.ndarray,
                            logits: torch.Tensor, draw_inputs: DrawInputs, drawn: torch.Tensor,
                            staged: bool, mask: GrammarMask | None) -> SamplerOutput:
        """_sample for a continued step: the graph's draws, `rows` drawn again under `mask`
        (`staged`: their draw's other inputs came in with the step's)."""
        sampled = self.sampler.masked_draw_rows(logits, request_ids, rows, draw_inputs, drawn,
                                                mask, staged)
        sampled.begin_host_copy()
        self._last_step = LaunchedStep(step_id, sampled.token_ids)
        return sampled

    @torch.inference_mode()  # a deferred sample runs after launch_on has returned
    def _sample(self, step_id: int, logits: torch.Tensor, plan: StepPlan,
                draw_inputs: DrawInputs, drawn: torch.Tensor | None,
                mask: GrammarMask | None) -> SamplerOutput:
        sampled = self.sampler(logits, plan.sample_rows, draw_inputs, drawn, mask)
        sampled = self.speculation.after_sample(plan, sampled)
        sampled.begin_host_copy()
        self._last_step = LaunchedStep(step_id, sampled.token_ids)
        return sampled

    def _forward(self, out: SchedulerOutput, sources: list[int], decode: bool,
                 draw_inputs: DrawInputs, kv_caches: list[KVCache], plan: StepPlan,
                 copies: tuple[tuple[int, int], ...]
                 ) -> tuple[torch.Tensor, torch.Tensor | None, PromptLogprobsOutput | None]:
        """Logits of the sampling rows in the model's dtype (`draw_inputs` are theirs), plus
        each one's draw when a graph made it, and the step's prompt logprobs, if it has
        PromptLogprobsJobs: they read every row's final hidden state, the eager forward's
        result or the mixed-step graph's static output of it, right after its replay.
        Graphs run on the cache they captured; decode steps never have prompt logprobs.
        `copies`: block copies left for the decode graphs to make (none in other steps)."""
        if out.is_empty:
            return torch.empty(0, self.model.config.vocab_size, dtype=self.dtype,
                               device=self.device), None, None
        seqs = out.sequences
        prev_tokens = self._prev_sampled(out, sources)
        if decode:  # _is_decode_step
            return *self.decode_graphs.run(seqs, sources, prev_tokens, draw_inputs,
                                           block_copies=copies), None
        host = prepare_host_inputs(seqs, self.block_size, self.max_blocks_per_seq)
        write_drafts = plan.write_drafts(host)
        if self.mixed_graphs is not None and self.mixed_graphs.fits(host):
            logits, drawn = self.mixed_graphs.run(host, sources, prev_tokens, draw_inputs,
                                                  write_drafts, plan.follow)
            if not out.has_prompt_logprobs:
                return logits, drawn, None
            hidden = self.mixed_graphs.hidden(len(host.token_ids))
        else:
            step = to_device(host, self.device)
            if prev_tokens is not None:
                take_placeholders(step, host, sources, prev_tokens)
            if write_drafts is not None:
                write_drafts(step.input_ids)
            hidden = self.model(step.input_ids, step.positions, kv_caches, step.meta)
            follower = self.speculation.follower
            if follower is not None and plan.follow:
                follower(step.input_ids, step.positions, step.meta)
            logits = drawn = None  # after the prompt logprobs' slices: not held beside them
        prompt_logprobs = None
        if out.has_prompt_logprobs:
            prompt_logprobs = compute_prompt_logprobs(hidden, self.model.lm_head,
                                                      self.model.ops.prompt_logprobs, seqs,
                                                      host.query_start_loc)
            prompt_logprobs.begin_host_copy()
        if logits is None:
            logits = self.model.lm_head(hidden[step.sample_indices])
        return logits, drawn, prompt_logprobs

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
class PlainDecode:
    """A launched decode step whose rows were all plain draws but for grammar masks
    (sampler.is_plain_but_masked), by sample row: each one's temperature, whether its
    request is seeded, whether it has structured outputs. What the next step's placeholder
    rows continue (ModelRunner._launch_plain_decode)."""
    step_id: int
    temperature: np.ndarray  # float32 [rows]
    seeded: np.ndarray  # bool [rows]
    constrained: np.ndarray  # bool [rows]
    seeds: np.ndarray  # object [rows]: its request's seed (0: none), a Python int of any size
    num_outputs: np.ndarray  # int64 [rows]: the output position the row samples

    @classmethod
    def of(cls, step_id: int, rows: list[ScheduledSequence], draw_inputs: DrawInputs
           ) -> PlainDecode:
        seeds = [s.params.seed for s in rows]
        return cls(step_id, draw_inputs[0],
                   np.array([seed is not None for seed in seeds], dtype=bool),
                   np.array([s.params.structured_outputs is not None for s in rows],
                            dtype=bool),
                   np.array([seed or 0 for seed in seeds], dtype=object),
                   np.array([s.num_output_tokens for s in rows], dtype=np.int64))

    def continued(self, step_id: int, src: np.ndarray) -> PlainDecode:
        """The step `step_id` whose row i continues row src[i] of this one, a token on (its
        parameters stay: a row's min_tokens only run out)."""
        return PlainDecode(step_id, self.temperature[src], self.seeded[src],
                           self.constrained[src], self.seeds[src], self.num_outputs[src] + 1)


def continued_rows(continued: DecodeContinuation) -> np.ndarray:
    """The continuation's src as an int64 array: the row of the step before each row
    continues."""
    if continued.src is None:
        return np.arange(len(continued.request_ids))
    return np.array(continued.src, dtype=np.int64)


def continues_plain_decode(last: PlainDecode | None, out: SchedulerOutput,
                           sources: list[int] | None, max_batch: int) -> bool:
    """Every row of `out` (`sources`: their prev_sample_row; None for out.continued's, each
    its own row) is a placeholder continuing a row of `last`, the decode step launched just
    before, whose rows were all plain draws but for grammar masks (so are these: a row's
    parameters stay, its min_tokens only run out), and the decode graphs hold them all."""
    if last is None or last.step_id != out.step_id - 1 or out.has_prompt_logprobs:
        return False
    if sources is None:
        return len(out.continued.request_ids) <= max_batch
    return bool(sources) and min(sources) >= 0 and len(sources) <= max_batch


@dataclass(frozen=True)
class LaunchedStep:
    """A launched step's sampled tokens, still on the device (None: it sampled nothing)."""
    step_id: int
    token_ids: torch.Tensor | None


@dataclass
class PendingStep:
    """A launched step whose sampled tokens are on their way to the host. A step with
    structured-output rows has launched its forward only: it `needs_mask`, and samples once
    `sample` gets its rows' GrammarMask, which must be before the next launch (whose
    placeholders name these tokens) and before `wait`."""
    request_ids: list[str]
    sampled: SamplerOutput | None
    sample_with: Callable[[GrammarMask | None], SamplerOutput] | None = None
    prompt_logprobs: PromptLogprobsOutput | None = None  # the step had PromptLogprobsJobs
    # indices into request_ids of the rows with structured outputs, which the mask covers
    constrained_rows: list[int] = field(default_factory=list)

    @property
    def needs_mask(self) -> bool:
        return self.sampled is None and self.sample_with is not None

    def sample(self, mask: GrammarMask | None) -> None:
        self.sampled = self.sample_with(mask)

    def wait(self) -> RunnerOutput:
        if self.needs_mask:
            raise RuntimeError("a step with structured-output rows was never sampled")
        if self.sampled is None:
            return RunnerOutput([], [], [], prompt_logprobs=self._prompt_logprobs())
        token_ids, logprobs = self.sampled.to_lists()
        return RunnerOutput(self.request_ids, token_ids, logprobs,
                            self.sampled.accepted_drafts(), self._prompt_logprobs())

    def _prompt_logprobs(self) -> dict[str, PromptLogprobs]:
        return {} if self.prompt_logprobs is None else self.prompt_logprobs.to_host()
