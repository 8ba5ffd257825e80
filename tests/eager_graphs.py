"""Graph sets on CPU: eager stand-ins for captured CUDA graphs, so the graph paths' staging,
inputs and replay order run without CUDA."""
from __future__ import annotations

from functools import partial

import torch

from engine.speculative.draft_model.chain_graphs import ChainPlan, DraftChainGraphs


class _EagerReplay:
    """Stands in for a captured graph on CPU: replay runs what it would have recorded."""

    def __init__(self, record):
        self.replay = record


class _EagerChain:
    """Stands in for a draft chain's graphs of one size: each iteration hands the next its
    plan and tokens, as the captured graphs read those of the graphs before them."""

    def __init__(self, chain: DraftChainGraphs, size: int):
        self.chain, self.size = chain, size
        self.iterations = [_EagerReplay(partial(self.run, i)) for i in range(chain.iterations)]
        self.catching_up = _EagerReplay(self.run_catching_up)
        self.ahead = _EagerReplay(self.run_ahead)

    def run(self, i: int) -> None:
        if i == 0:
            self.plan, self.tokens = self.chain.first_iteration(self.size)
        else:
            self.tokens = self.chain.iteration(self.size, i, self.plan, self.tokens)

    def run_catching_up(self) -> None:
        self.plan, self.tokens = self.chain.first_iteration_catching_up(self.size)

    def run_ahead(self) -> None:
        """Into fresh outputs, where the graph writes the plain first iteration's."""
        shape = (self.chain.iterations, self.size)
        self.plan = ChainPlan(*(torch.zeros(shape, dtype=dtype) for dtype in
                                (torch.int64, torch.int64, torch.int32, torch.bool)))
        self.tokens = torch.zeros(self.size, dtype=torch.int64)
        self.chain.first_iteration_ahead(self.size, (self.plan, self.tokens))


def _refresh_outputs(graphs, size: int) -> None:
    graphs.outputs[size] = graphs.forward(size)


def replay_eagerly(graphs) -> None:
    """Give a graph set on CPU eager replays, as capture would give it graphs: a draft
    chain a replay per iteration, any other set one per size (and the follower's)."""
    for size in graphs.sizes:
        if isinstance(graphs, DraftChainGraphs):
            eager = _EagerChain(graphs, size)
            graphs.graphs[size] = eager.iterations
            graphs.catching_up_graphs[size] = eager.catching_up
            graphs.ahead_graphs[size] = eager.ahead
            continue
        graphs.graphs[size] = _EagerReplay(partial(_refresh_outputs, graphs, size))
        if graphs.follower is not None:
            graphs.follow_graphs[size] = _EagerReplay(partial(graphs.follow, size))
