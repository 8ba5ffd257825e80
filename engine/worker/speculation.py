"""What the runner asks of speculative decoding; engine/speculative/ answers, and a runner
without speculation gets `NO_SPECULATION`, which changes nothing.

    launch(out)    plan = speculation.plan(out, to_sample)     the rows the sampler draws
                   forward: plan.write_drafts(host) fills device-side draft slots;
                            speculation.follower runs over the step's inputs if plan.follow
                   sampled = speculation.after_sample(plan, sampled)   one token a sequence

`plan.sample_rows` may hold more rows than sampling sequences (d + 1 per sequence with d
drafts); `after_sample` returns one row per sampling sequence, with its accepted drafts in
`verified_token_ids`, and may start the host copy itself (`begin_host_copy` is idempotent).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from engine.core.batch import ScheduledSequence, SchedulerOutput
from engine.worker.cuda_graphs.graph_set import Follower
from engine.worker.cuda_graphs.mixed import WriteDrafts
from engine.worker.inputs import HostInputs
from engine.worker.sampler import SamplerOutput


@dataclass(frozen=True)
class StepPlan:
    sample_rows: list[ScheduledSequence]  # one per position the sampler draws at
    follow: bool = True  # the follower (if any) runs over this step
    draft_writer: Callable[[HostInputs], WriteDrafts] | None = None  # of device-side drafts
    drafts: Any = None  # the implementation's own: what after_sample verifies against

    def write_drafts(self, host: HostInputs) -> WriteDrafts | None:
        return None if self.draft_writer is None else self.draft_writer(host)


class Speculation(Protocol):
    follower: Follower | None  # captured beside the step graphs when set

    def plan(self, out: SchedulerOutput, to_sample: list[ScheduledSequence]) -> StepPlan: ...

    def after_sample(self, plan: StepPlan, sampled: SamplerOutput) -> SamplerOutput: ...


class NoSpeculation:
    follower = None

    def plan(self, out: SchedulerOutput, to_sample: list[ScheduledSequence]) -> StepPlan:
        return StepPlan(to_sample)

    def after_sample(self, plan: StepPlan, sampled: SamplerOutput) -> SamplerOutput:
        return sampled


NO_SPECULATION = NoSpeculation()
