"""Which step graphs a runner captures: the one owner of their sizes, and of the row counts
the model's linears run at inside them (what the skinny GEMM table measures)."""
from __future__ import annotations

from dataclasses import dataclass

from engine.core.config import EngineConfig

# the smallest mixed-step graph: a one-stream verification of k = 2 (3 tokens); its padding
# costs more than the graph's rows (the linears' tiles hold 16 rows, but their fused
# LayerNorm takes two more: M = 16 doubles the skinny GEMM's tile, M = 8 does not)
MIN_MIXED_TOKENS = 4


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes: 1, 2, 4, 8, then steps of 8 up to max_num_seqs (always included)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(8 if max_num_seqs > 8 else max_num_seqs, max_num_seqs, 8))
    sizes.append(max_num_seqs)
    return sorted(set(sizes))


def mixed_capture_sizes(max_num_batched_tokens: int) -> list[int]:
    """Mixed-step token counts: powers of two from MIN_MIXED_TOKENS, then the token budget
    itself."""
    sizes = [1 << p for p in range(MIN_MIXED_TOKENS.bit_length() - 1,
                                   max_num_batched_tokens.bit_length())
             if 1 << p < max_num_batched_tokens]
    return sizes + [max(max_num_batched_tokens, MIN_MIXED_TOKENS)]


def power_of_two_sizes(max_rows: int) -> list[int]:
    """Row counts of the per-row graphs (masked draw, logprobs): 1, 2, 4, ... up to the first
    that holds max_rows."""
    sizes = [1 << i for i in range(max(1, max_rows).bit_length())]
    return sizes if sizes[-1] >= max_rows else [*sizes, sizes[-1] * 2]


@dataclass(frozen=True)
class GraphPlan:
    decode_sizes: tuple[int, ...]  # batch sizes of the decode graphs (and the draft chain's)
    mixed_sizes: tuple[int, ...]  # token counts of the mixed-step graphs; (): none
    max_sample_rows: int  # logits rows a step may sample: a row per draft too

    @classmethod
    def of(cls, config: EngineConfig) -> GraphPlan:
        sched = config.scheduler
        mixed = (mixed_capture_sizes(sched.max_num_batched_tokens)
                 if config.model.mixed_step_graphs else [])
        return cls(tuple(capture_sizes(sched.max_num_seqs)), tuple(mixed),
                   sched.max_num_seqs * (config.max_drafts + 1))

    def linear_row_counts(self) -> list[int]:
        """The decode sizes, twice each (a draft chain starts with two rows a sequence), and
        the mixed-step token counts."""
        return sorted({*self.decode_sizes, *(2 * s for s in self.decode_sizes),
                       *self.mixed_sizes})

    def logits_rows(self) -> int:
        """Logits rows the captured graphs keep between replays: the StepOutputs that every
        size writes (with its spare row) and the logprobs' graphs' static rows."""
        return self.max_sample_rows + 1 + power_of_two_sizes(self.decode_sizes[-1])[-1]
