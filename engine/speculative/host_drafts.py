"""The runner's side of a host proposer (n-gram): the scheduler already wrote the drafts
into each sequence's token ids, so the runner samples at every position and verifies."""
from __future__ import annotations

import torch

from engine.core.batch import ScheduledSequence, SchedulerOutput
from engine.speculative.verify import host_drafts, position_rows, verify_drafts
from engine.worker.sampler import SamplerOutput
from engine.worker.speculation import StepPlan


class HostDraftSpeculation:
    follower = None

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def plan(self, out: SchedulerOutput, to_sample: list[ScheduledSequence]) -> StepPlan:
        if not out.num_draft_tokens:
            return StepPlan(to_sample)
        return StepPlan(position_rows(to_sample),
                        drafts=(to_sample, host_drafts(to_sample, self.device)))

    def after_sample(self, plan: StepPlan, sampled: SamplerOutput) -> SamplerOutput:
        if plan.drafts is None:
            return sampled
        return verify_drafts(sampled, *plan.drafts)
