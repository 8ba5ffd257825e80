"""CUDA graphs for whole steps: the forward pass, the logits and each row's draw, captured
once per padded size and replayed, so a step costs one graph launch instead of ~10 kernel
launches per layer from Python.

Two sets share one memory pool, each beside the stager that writes its inputs, at the
sizes GraphPlan (plan.py) gives:

* `DecodeGraphs` (decode.py): one token per sequence, per padded batch size.
* `MixedGraphs` (mixed.py): steps with prompt tokens, per padded token count.

A third, `DraftChainGraphs` (engine/speculative/draft_model/chain_graphs.py), holds the draft model's greedy iterations (a
graph per iteration and padded batch size, staged once a step) in a pool of its own.

Each set reads two packed device buffers with named layouts (buffers.py), copied from pinned
memory (two copies per step):

    tokens  int64   prev_tokens (device-filled) | token_ids | positions | slot_mapping |
                    token_source | draw_seeds | draw_temperature (float64 bits)
    meta    int32   per-sequence metadata and block tables (the set's own layout)

A graph gathers its input ids from prev_tokens | token_ids by token source: a known token's
own entry in token_ids, or a placeholder's sampled token in prev_tokens.
"""
from engine.worker.cuda_graphs.decode import DecodeGraphs, DecodeStager, decode_meta_layout
from engine.worker.cuda_graphs.mixed import MixedGraphs, MixedStager, mixed_meta_layout
from engine.worker.cuda_graphs.plan import (MIN_MIXED_TOKENS, GraphPlan, capture_sizes,
                                            mixed_capture_sizes)

__all__ = ["MIN_MIXED_TOKENS", "DecodeGraphs", "DecodeStager", "GraphPlan", "MixedGraphs",
           "MixedStager", "capture_sizes", "decode_meta_layout", "mixed_capture_sizes",
           "mixed_meta_layout"]
