"""The draft model of the draft_model method, on the worker side: a second ModelRunner (the
draft's weights, its KV pool, its decode path and decode graphs) whose pool has the target's
block count and block size, so the target's block tables and slot mappings index it too and
the block manager stays the one owner of blocks.

    every step but    follow(): the draft's forward over the target step's own inputs
    verification-     (prefill chunks, decodes, verification rows), in the same launch or
    only ones         a CUDA graph of its own replayed after the target's, writing draft KV
                      wherever the target writes KV; a step whose every sequence verifies
                      drafts skips it (fill wrote their KV but the last draft's: _catch_up)
    before a step     fill(): k greedy decode iterations over the speculating sequences,
    with drafts       queued on the device; their tokens, a device tensor, fill the step's
                      UNFILLED_DRAFT slots there (ModelRunner._draft_writer) and are judged
                      there, so the host never waits for a draft

    iteration  0        1        2        3          (k = 4, last token t19 at position 19)
    feeds      t19@19   d1@20    d2@21    d3@22      each writes the draft's KV there
    argmax     d1       d2       d3       d4         iteration i + 1 reads i's on the device

So the draft has KV for every token the target has KV for (prefix-cache hits included: a
cached block was computed with the draft following), and a rejected draft's slots are
overwritten later, as the target's are. The drafts are the argmax: one-hot q, which makes the
existing verification (`accept_drawn`) exact rejection sampling for sampled rows too.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from engine.core.batch import PLACEHOLDER_TOKEN, ScheduledSequence, SchedulerOutput
from engine.core.config import EngineConfig, check_draft_model
from engine.core.request import SamplingParams
from engine.worker.attention import AttentionMetadata
from engine.worker.inputs import upload
from engine.worker.spec_verify import NO_TOKEN
from engine.worker.models.gpt2 import GPT2Config, find_checkpoint

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
    def __init__(self, runner) -> None:
        """runner: the draft's ModelRunner (draft_runner_config)."""
        self.runner = runner
        self._step_id = 0  # the draft runner's own steps: iteration i + 1 reads i's tokens
        # the last fill's drafts, and for a step run without the follow pass, each request's
        # last draft: (its position, its index in the flattened drafts); see _catch_up
        self._last_drafts: torch.Tensor | None = None
        self._unfollowed: dict[str, tuple[int, int]] = {}

    def follow(self, input_ids: torch.Tensor, positions: torch.Tensor,
               meta: AttentionMetadata) -> None:
        """The draft's forward over a target step's inputs, for its KV only."""
        self.runner.model(input_ids, positions, self.runner.kv_caches, meta)

    def fill(self, seqs: list[ScheduledSequence], skips_follow: bool) -> torch.Tensor:
        """The draft's greedy guesses for `seqs` (a step's sampling sequences), as
        [len(seqs), most drafts] int64 on the device, NO_TOKEN past a sequence's own.
        Iteration i + 1 reads iteration i's tokens on the device: every iteration is queued
        without a host sync, and so is the target's step after them. `skips_follow`: the
        target's step will run without the follow pass."""
        width = max(s.num_drafts for s in seqs)
        drafts = torch.full((len(seqs), width), NO_TOKEN, dtype=torch.int64,
                            device=self.runner.device)
        self._catch_up(seqs)
        speculating = [row for row, s in enumerate(seqs) if s.num_drafts]
        rows_before: dict[int, int] = {}
        for i in range(width):
            active = [row for row in speculating if seqs[row].num_drafts > i]
            steps = [_draft_row(seqs[row], i, rows_before.get(row, -1)) for row in active]
            rows_before = {row: n for n, row in enumerate(active)}
            self._step_id += 1
            pending = self.runner.launch_on(SchedulerOutput(steps, step_id=self._step_id),
                                            self.runner.kv_caches, copy_to_host=False)
            # before the next iteration's replay overwrites the graph's output
            drafts[upload(active, torch.int64, drafts.device), i] = pending.sampled.token_ids
        self._last_drafts = drafts
        self._unfollowed = {s.request_id: (s.start_position + s.num_drafts,
                                           row * width + s.num_drafts - 1)
                            for row, s in enumerate(seqs) if s.num_drafts and skips_follow}
        return drafts

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
        self._step_id += 1
        self.runner.launch_on(SchedulerOutput(steps, step_id=self._step_id),
                              self.runner.kv_caches, copy_to_host=False,
                              placeholder_tokens=self._last_drafts.view(-1)[flat])


def _draft_row(seq: ScheduledSequence, i: int, source: int) -> ScheduledSequence:
    """Iteration i of seq's drafting: its last known token (i = 0), else the draft that
    iteration i - 1 drew, row `source` of its output; at the position after the previous."""
    known = len(seq.token_ids) - seq.num_drafts
    token = seq.token_ids[known - 1] if i == 0 else PLACEHOLDER_TOKEN
    return ScheduledSequence(seq.request_id, [token], seq.start_position + known - 1 + i,
                             seq.block_ids, True, GREEDY, prev_sample_row=source)
