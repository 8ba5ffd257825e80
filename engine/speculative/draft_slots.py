"""The draft_model method's proposer on the scheduler's side: it only reserves k slots after
a speculating request's last token, which the draft model fills on the device (`Drafter.fill`)
between scheduling and verification:

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
