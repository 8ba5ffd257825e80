"""CUDA graphs for whole steps (forward, logits, each row's draw), one per padded size at
GraphPlan's sizes (plan.py): `DecodeGraphs` per batch size, `MixedGraphs` (steps with prompt
tokens) per token count; both share one memory pool and write their logits and draws into
one `StepOutputs`. `MaskedDrawGraphs` (masked_draw.py) replay the masked draw of a step's
structured-output rows there, `LogprobGraphs` (logprob_graphs.py) the logprobs of its rows
that ask for them, `BlockCopyGraph` (block_copy_graph.py) its forked beams' block copies.

Each set reads two packed buffers (buffers.py), back to back in one device allocation, and
copied from pinned memory each step in one copy (token_ids up to the last table row used):

    tokens  int64   prev_tokens (device-filled) | token_ids | positions | slot_mapping |
                    token_source | draw_seeds | draw_temperature (float64 bits) |
                    block_copies (decode graphs: a step's forked beams' block pairs)
    meta    int32   per-sequence metadata and block tables (the set's own layout)

token_source indexes prev_tokens | token_ids: a placeholder's sampled token, or a known token.
The decode and mixed-step sets read a placeholder's token in the StepOutputs instead, where the
last graph step drew it (Ops.gather_tokens): prev_tokens serves sets without StepOutputs (a
draft chain's), and the host copies previous tokens in only when no graph drew them.
"""
from engine.worker.cuda_graphs.block_copy_graph import BlockCopyGraph
from engine.worker.cuda_graphs.decode import (Continued, DecodeGraphs, DecodeStager,
                                              decode_meta_layout)
from engine.worker.cuda_graphs.graph_set import StepOutputs
from engine.worker.cuda_graphs.logprob_graphs import LogprobGraphs
from engine.worker.cuda_graphs.masked_draw import MaskedDrawGraphs
from engine.worker.cuda_graphs.mixed import MixedGraphs, MixedStager, mixed_meta_layout
from engine.worker.cuda_graphs.plan import (MIN_MIXED_TOKENS, GraphPlan, capture_sizes,
                                            mixed_capture_sizes)

__all__ = ["MIN_MIXED_TOKENS", "BlockCopyGraph", "Continued", "DecodeGraphs", "DecodeStager",
           "GraphPlan", "LogprobGraphs", "MaskedDrawGraphs", "MixedGraphs", "MixedStager",
           "StepOutputs", "capture_sizes", "decode_meta_layout", "mixed_capture_sizes",
           "mixed_meta_layout"]
