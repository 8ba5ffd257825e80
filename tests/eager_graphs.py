"""Graph sets (and the masked draw's, logprobs' and block copies' graphs) on CPU: eager
stand-ins for captured CUDA graphs, so the graph paths' staging, inputs and replay order run
without CUDA. (A draft chain needs none: uncaptured, it runs its iterations eagerly itself.)"""
from __future__ import annotations

from functools import partial


class _EagerReplay:
    """Stands in for a captured graph on CPU: replay runs what it would have recorded."""

    def __init__(self, record):
        self.replay = record


def _refresh_outputs(graphs, size: int) -> None:
    graphs.outputs[size] = graphs.forward(size)


def replay_eagerly(graphs) -> None:
    """Give a graph set on CPU eager replays, as capture would give it graphs: one per size
    (and the follower's, and a decode set's block copies')."""
    for size in graphs.sizes:
        graphs.graphs[size] = _EagerReplay(partial(_refresh_outputs, graphs, size))
        if graphs.follower is not None:
            graphs.follow_graphs[size] = _EagerReplay(partial(graphs.follow, size))
    if getattr(graphs, "block_copy", None) is not None:
        replay_block_copy_eagerly(graphs.block_copy)


def replay_block_copy_eagerly(graph) -> None:
    """BlockCopyGraph on CPU: its replay runs what its graph would record."""
    graph.graph = _EagerReplay(graph.record)


def replay_logprobs_eagerly(graphs) -> None:
    """LogprobGraphs on CPU: each replay runs what its graph would record, and its outputs
    are what that run returned."""
    def refresh(key: tuple[bool, int, int]) -> None:
        graphs.outputs[key] = graphs.record(*key)

    for key in graphs.keys:
        graphs.graphs[key] = _EagerReplay(partial(refresh, key))


def replay_masked_draw_eagerly(graphs, staged: bool = False) -> None:
    """MaskedDrawGraphs on CPU: each size's replay runs what its graph would record (and its
    staged twin's, if `staged`)."""
    for key in [(twin, size) for twin in ((False, True) if staged else (False,))
                for size in graphs.sizes]:
        graphs.graphs[key] = _EagerReplay(partial(graphs.record, key[1], key[0]))
