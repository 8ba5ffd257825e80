"""The draft model of the draft_model method, on the worker side: a second ModelRunner (the
draft's weights, its KV pool, its decode path and decode graphs) whose pool has the target's
block count and block size, so the target's block tables and slot mappings index it too and
the block manager stays the one owner of blocks.

    every step but    follow(): the draft's forward over the target step's own inputs
    verification-     (prefill chunks, decodes, verification rows), in the same launch or
    only ones         a CUDA graph of its own replayed after the target's, writing draft KV
                      wherever the target writes KV; a step whose every sequence verifies
                      drafts skips it (fill wrote their KV but the last draft's: _catch_up)
    before a step     fill(): the draft's greedy iterations over the sampling sequences,
    with drafts       chained on the device (cuda_graphs/draft_chain.py: one graph launch
                      on CUDA); their tokens, a device tensor, fill the step's
                      UNFILLED_DRAFT slots there (ModelRunner._draft_writer) and are judged
                      there, so the host never waits for a draft

So the draft has KV for every token the target has KV for (prefix-cache hits included: a
cached block was computed with the draft following), and a rejected draft's slots are
overwritten later, as the target's are. The drafts are the argmax: one-hot q, which makes the
existing verification (`accept_drawn`) exact rejection sampling for sampled rows too.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from pathlib import Path

import torch

from engine.core.batch import PLACEHOLDER_TOKEN, ScheduledSequence, SchedulerOutput
from engine.core.config import EngineConfig, check_draft_model
from engine.core.request import SamplingParams
from engine.worker.attention import AttentionMetadata
from engine.worker.cuda_graphs.draft_chain import DraftChainGraphs, greedy_chain
from engine.worker.inputs import prepare_host_inputs, to_device, upload
from engine.worker.models.gpt2 import GPT2Config, find_checkpoint

log = logging.getLogger(__name__)
GREEDY = SamplingParams(temperature=0.0)


def find_draft(config: EngineConfig, target_dir: Path) -> GPT2Config | None:
    """The draft model's config (None: no draft_model method), once its HF config.json and
    the target's pass `check_draft_model` (a ConfigError naming the field if not)."""
    spec = config.speculative
    if spec is None or spec.method != "draft_model":
        return None
    draft_dir, draft = find_checkpoint(spec.model)
    check_draft_model(_hf_config(target_dir), _hf_config(draft_dir))
    return draft


def _hf_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def draft_runner_config(config: EngineConfig, num_kv_blocks: int) -> EngineConfig:
    """The draft's runner: the target's device, dtype and attention backend, the draft's
    weights, a pool of the target's num_kv_blocks, decode graphs only, no speculation."""
    return replace(config, model=replace(config.model, model=config.speculative.model,
                                         mixed_step_graphs=False),
                   cache=replace(config.cache, num_kv_blocks=num_kv_blocks), speculative=None)


class Drafter:
    def __init__(self, runner, max_drafts: int) -> None:
        """runner: the draft's ModelRunner (draft_runner_config); with CUDA graphs, its
        iterations are captured too, up to max_drafts, in its graphs' pool."""
        self.runner = runner
        self.chain = None if runner.decode_graphs is None else self._capture_chain(max_drafts)
        # the last fill's drafts, and for a step run without the follow pass, each request's
        # last draft: (its position, its index in the flattened drafts); see _catch_up
        self._last_drafts: torch.Tensor | None = None
        self._unfollowed: dict[str, tuple[int, int]] = {}

    def _capture_chain(self, max_drafts: int) -> DraftChainGraphs:
        runner, sched, start = self.runner, self.runner.config.scheduler, time.perf_counter()
        chain = DraftChainGraphs(runner.model, runner.kv_caches, sched.max_num_seqs,
                                 runner.max_blocks_per_seq, runner.block_size,
                                 sched.max_model_len, runner.device, max_drafts)
        runner.graph_pool = chain.capture(runner.graph_pool)
        log.info("captured the draft's %d iterations for batch sizes %s in %.1f s", max_drafts,
                 chain.sizes, time.perf_counter() - start)
        return chain

    def follow(self, input_ids: torch.Tensor, positions: torch.Tensor,
               meta: AttentionMetadata) -> None:
        """The draft's forward over a target step's inputs, for its KV only."""
        self.runner.model(input_ids, positions, self.runner.kv_caches, meta)

    def fill(self, seqs: list[ScheduledSequence], skips_follow: bool) -> torch.Tensor:
        """The draft's greedy guesses for `seqs` (a step's sampling sequences), as
        [len(seqs), most drafts] int64 on the device, NO_TOKEN past a sequence's own; queued
        without a host sync, as the target's step after them is. `skips_follow`: the
        target's step will run without the follow pass."""
        self._catch_up(seqs)
        width = max(s.num_drafts for s in seqs)
        rows, counts = [_chain_row(s) for s in seqs], [s.num_drafts for s in seqs]
        drafts = (self.chain.run(rows, counts) if self.chain is not None
                  else self._eager_chain(rows, counts, width))
        self._last_drafts = drafts
        self._unfollowed = {s.request_id: (s.start_position + s.num_drafts,
                                           row * width + s.num_drafts - 1)
                            for row, s in enumerate(seqs) if s.num_drafts and skips_follow}
        return drafts

    def _eager_chain(self, rows: list[ScheduledSequence], counts: list[int],
                     width: int) -> torch.Tensor:
        """greedy_chain without graphs (CPU, eager mode, the torch attention backend)."""
        runner, model = self.runner, self.runner.model
        step = to_device(prepare_host_inputs(rows, runner.block_size, runner.max_blocks_per_seq),
                         runner.device)
        greedy = torch.zeros(len(rows), device=runner.device)

        def draw(hidden: torch.Tensor) -> torch.Tensor:
            return model.ops.sample(model.lm_head(hidden), greedy, greedy.long())

        return greedy_chain(model, runner.kv_caches, step.input_ids, step.positions, step.meta,
                            upload(counts, torch.int32, runner.device), width, draw)

    def _catch_up(self, seqs: list[ScheduledSequence]) -> None:
        """A verification step without the follow pass leaves the draft without KV at each
        row's last draft (fill's iterations wrote the ones before it). A request that
        accepted every draft decodes from the position after it: one decode iteration feeds
        those last drafts, read on the device from the last fill's, at their positions."""
        lagging = [(s, *self._unfollowed[s.request_id]) for s in seqs
                   if s.num_drafts and s.request_id in self._unfollowed
                   and self._unfollowed[s.request_id][0] == s.start_position - 1]
        if not lagging:
            return
        steps = [ScheduledSequence(s.request_id, [PLACEHOLDER_TOKEN], position, s.block_ids,
                                   True, GREEDY, prev_sample_row=n)
                 for n, (s, position, _) in enumerate(lagging)]
        flat = upload([index for _, _, index in lagging], torch.int64, self.runner.device)
        self.runner.launch_on(SchedulerOutput(steps), self.runner.kv_caches, copy_to_host=False,
                              placeholder_tokens=self._last_drafts.reshape(-1)[flat])


def _chain_row(seq: ScheduledSequence) -> ScheduledSequence:
    """seq's first drafting iteration: its last known token at its position (token 0 for a
    sequence without drafts, whose row writes and returns nothing)."""
    known = len(seq.token_ids) - seq.num_drafts
    token = seq.token_ids[known - 1] if seq.num_drafts else 0
    return ScheduledSequence(seq.request_id, [token], seq.start_position + known - 1,
                             seq.block_ids, True, GREEDY)
