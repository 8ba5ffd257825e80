"""The draft model of the draft_model method, on the worker side: a second ModelRunner (the
draft's weights, its KV pool, its decode path and decode graphs) whose pool has the target's
block count and block size, so the target's block tables and slot mappings index it too and
the block manager stays the one owner of blocks.

    every step        follow(): the draft's forward over the target step's own inputs
                      (prefill chunks, decodes, verification rows), in the same launch or
                      CUDA graph, writing draft KV wherever the target writes KV
    before a step     fill(): k greedy decode iterations over the speculating sequences,
    with drafts       then their tokens replace the step's UNFILLED_DRAFT slots

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

    def follow(self, input_ids: torch.Tensor, positions: torch.Tensor,
               meta: AttentionMetadata) -> None:
        """The draft's forward over a target step's inputs, for its KV only."""
        self.runner.model(input_ids, positions, self.runner.kv_caches, meta)

    def fill(self, out: SchedulerOutput) -> SchedulerOutput:
        """`out` with each speculating sequence's draft slots holding the draft's greedy
        guesses. Iteration i + 1 reads iteration i's tokens on the device, and is launched
        before i's tokens are waited for, as the engine runs steps one ahead (the graphs'
        pinned staging holds two steps): one host sync per iteration, overlapped with the
        next."""
        speculating = [s for s in out.sequences if s.num_drafts]
        drafts: list[list[int]] = [[] for _ in speculating]
        in_flight, rows_before = [], {}
        for i in range(max(s.num_drafts for s in speculating)):
            active = [j for j, s in enumerate(speculating) if s.num_drafts > i]
            rows = [_draft_row(speculating[j], i, rows_before.get(j, -1)) for j in active]
            rows_before = {j: row for row, j in enumerate(active)}
            self._step_id += 1
            in_flight.append((active, self.runner.launch(SchedulerOutput(
                rows, step_id=self._step_id))))
            if len(in_flight) == 2:
                _collect(drafts, *in_flight.pop(0))
        for launched in in_flight:
            _collect(drafts, *launched)
        filled = iter(replace(s, token_ids=s.token_ids[:-s.num_drafts] + d)
                      for s, d in zip(speculating, drafts))
        return replace(out, sequences=[next(filled) if s.num_drafts else s
                                       for s in out.sequences])


def _collect(drafts: list[list[int]], active: list[int], pending) -> None:
    """Wait for one iteration's tokens and append each to its sequence's drafts."""
    for j, token in zip(active, pending.wait().sampled_token_ids):
        drafts[j].append(token)


def _draft_row(seq: ScheduledSequence, i: int, source: int) -> ScheduledSequence:
    """Iteration i of seq's drafting: its last known token (i = 0), else the draft that
    iteration i - 1 drew, row `source` of its output; at the position after the previous."""
    known = len(seq.token_ids) - seq.num_drafts
    token = seq.token_ids[known - 1] if i == 0 else PLACEHOLDER_TOKEN
    return ScheduledSequence(seq.request_id, [token], seq.start_position + known - 1 + i,
                             seq.block_ids, True, GREEDY, prev_sample_row=source)
