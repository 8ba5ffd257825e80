"""The draft_model method behind the runner's protocol (engine/worker/speculation.py): the
draft's checkpoint check, its memory beside the target's pool, its runner, and each step's
drafting around the target's forward (drafter.py: the draft's side)."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch

from engine.core.batch import ScheduledSequence, SchedulerOutput
from engine.core.config import EngineConfig, check_draft_model
from engine.speculative.draft_model.drafter import Drafter
from engine.speculative.verify import draft_token_rows, position_rows, verify_drafts
from engine.worker.cuda_graphs.mixed import WriteDrafts
from engine.worker.inputs import HostInputs, upload
from engine.worker.kv_sizing import GRAPH_MARGIN, kv_block_bytes
from engine.worker.model_runner import ModelRunner
from engine.worker.models.gpt2 import GPT2Config, find_checkpoint
from engine.worker.sampler import SamplerOutput
from engine.worker.speculation import StepPlan


@dataclass(frozen=True)
class DraftCheckpoint:
    model_dir: Path
    config: GPT2Config


def find_draft(config: EngineConfig, target_dir: Path) -> DraftCheckpoint | None:
    """The draft model's checkpoint (None: no draft_model method), once its HF config.json
    and the target's pass `check_draft_model` (a ConfigError naming the field if not)."""
    spec = config.speculative
    if spec is None or spec.method != "draft_model":
        return None
    draft_dir, draft = find_checkpoint(spec.model)
    check_draft_model(_hf_config(target_dir), _hf_config(draft_dir))
    return DraftCheckpoint(draft_dir, draft)


def _hf_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def draft_memory(draft: GPT2Config, block_size: int, dtype: torch.dtype, max_num_seqs: int,
                 quantization: str | None = None) -> tuple[int, int]:
    """(bytes a KV block of the target's pool costs the draft's pool beside it, bytes the
    draft takes beside its pool: its weights (with `quantization`, the blocks' linears at one
    byte a weight plus a float32 scale a row, as engine/worker/quantization.py stores them),
    its chain graphs' working memory (the logits of one iteration at the largest batch: no
    graph keeps logits between replays), a margin)."""
    weights = draft.num_parameters * dtype.itemsize
    if quantization is not None:
        d, inner = draft.n_embd, draft.n_inner
        elements, rows = 4 * d * d + 2 * d * inner, 5 * d + inner  # QKV, O, FC, projection
        weights -= draft.n_layer * (elements * (dtype.itemsize - 1) - 4 * rows)
    logits = max_num_seqs * draft.padded_vocab_size * dtype.itemsize
    return kv_block_bytes(draft, block_size, dtype), weights + logits + GRAPH_MARGIN


def build_draft(config: EngineConfig, target: ModelRunner, draft: DraftCheckpoint
                ) -> DraftModelSpeculation:
    """The draft's runner: the target's device, dtype and attention backend, a pool of the
    target's block count and size (the target's block tables index it), no speculation and
    no step graphs of its own."""
    start = time.perf_counter()
    runner = ModelRunner(replace(config, model=replace(config.model, model=str(draft.model_dir)),
                                 speculative=None), draft.model_dir, draft.config)
    runner.allocate(target.num_kv_blocks)
    speculation = DraftModelSpeculation(Drafter(runner, target.max_drafts))
    target.startup.add("draft model", time.perf_counter() - start)
    return speculation


class DraftModelSpeculation:
    """Each step: the draft follows the target's forward (its KV wherever the target writes
    KV), unless `Drafter.skips_follow`; before a step with drafts it drafts on the device
    (`Drafter.fill`), the drafts are written into the step's token ids there and judged
    there; after a step without the follow it drafts the next step at once
    (`Drafter.draft_ahead`), and the next step takes those drafts if it is the one they were
    made for."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
        self.follower = drafter.follow
        self._drafted_ahead: list[tuple[str, int]] | None = None  # for the next step only

    def plan(self, out: SchedulerOutput, to_sample: list[ScheduledSequence]) -> StepPlan:
        drafted_ahead, self._drafted_ahead = self._drafted_ahead, None
        follow = not self.drafter.skips_follow(out.sequences)
        if not out.num_draft_tokens:
            return StepPlan(to_sample, follow)
        drafts = self.drafter.fill(to_sample, drafted_ahead == _drafting(to_sample))
        return StepPlan(position_rows(to_sample), follow, partial(_writer, to_sample, drafts),
                        (to_sample, drafts))

    def after_sample(self, plan: StepPlan, sampled: SamplerOutput) -> SamplerOutput:
        if plan.drafts is None:
            return sampled
        sampled = verify_drafts(sampled, *plan.drafts)
        if not plan.follow:
            sampled.begin_host_copy()  # first: the host then waits for the copies only
            self.drafter.draft_ahead(plan.drafts[0], sampled)
            self._drafted_ahead = _drafting(plan.drafts[0])
        return sampled


def _drafting(seqs: list[ScheduledSequence]) -> list[tuple[str, int]]:
    """What drafts made ahead must match: each sequence and its draft count, in order."""
    return [(s.request_id, s.num_drafts) for s in seqs]


def _writer(seqs: list[ScheduledSequence], drafts: torch.Tensor, host: HostInputs
            ) -> WriteDrafts:
    """input_ids -> None: writes `drafts` into the token rows of the draft slots."""
    rows, flat = draft_token_rows(seqs, host.sample_indices, drafts.shape[1])
    rows, flat = (upload(a, torch.int64, drafts.device) for a in (rows, flat))
    return lambda input_ids: input_ids.index_put_((rows,), drafts.reshape(-1)[flat])
