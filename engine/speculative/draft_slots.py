"""The draft_model method's proposer on the scheduler's side: it reserves draft slots only.

The draft model runs on the device, batched over a step's speculating sequences, after the
step is scheduled and before the target verifies it (`Drafter.fill`, engine/worker/
drafter.py). So in the scheduler a speculating request's step just holds k slots after its
last token, which the drafter fills in:

    schedule():  [t19, UNFILLED_DRAFT x 4]   ─▶   Drafter.fill():  [t19, d1, d2, d3, d4]
"""
from __future__ import annotations

from engine.core.batch import UNFILLED_DRAFT
from engine.speculative.proposer import DraftContext


class DraftSlots:
    def propose(self, context: DraftContext) -> list[int]:
        """As many slots as the request may draft: the draft model always guesses."""
        return [UNFILLED_DRAFT] * context.max_drafts

    def release(self, request_id: str) -> None:
        """No per-request state: the draft's KV lives in the target's blocks."""
