"""The engine that scripts/bench_spec.py measures, and what a run reads off it: one LLM
configured to speculate with the largest k, re-configured per measurement (proposer, draft
length, switch), with the counters, acceptance and divergence from plain decoding of a run.
"""
from __future__ import annotations

import argparse
import random
import time
from itertools import zip_longest

import numpy as np
import torch
from bench_utils import checkpoint_for

from engine import LLM, SamplingParams
from engine.core.batch import ScheduledSequence
from oracle_proposer import OracleProposer
from engine.speculative.switch import SpeculationSwitch
from engine.worker.inputs import upload
from engine.speculative.verify import NO_TOKEN

VOCAB = 50257


def numbers(text: str, kind=float) -> list:
    return [kind(x) for x in text.split(",")]


def largest_k(args: argparse.Namespace) -> int:
    return max(numbers(args.ks, int) + [args.batch_k])


NGRAM = {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4}


class Bench:
    """One engine, configured to speculate with the largest k (`speculative`: vLLM's dict
    less num_speculative_tokens; None: no speculation); each measurement sets its proposer,
    draft length and switch."""

    def __init__(self, args: argparse.Namespace, speculative: dict | None = NGRAM,
                 **overrides) -> None:
        self.args = args
        dtype = args.dtype or ("float16" if args.device == "cuda" else "float32")
        spec = None if speculative is None else {**speculative,
                                                 "num_speculative_tokens": largest_k(args)}
        self.llm = LLM(model=checkpoint_for(args.model), device=args.device, dtype=dtype,
                       max_num_seqs=max(numbers(args.batches, int)),
                       speculative_config=spec, **overrides)
        self.engine = self.llm.engine
        self.speculator = self.engine.core.speculator
        self._next = 0
        self.judged = 0  # drafts the target judged: a row's run ends at its first rejection
        if self.speculator is None:
            return
        switch = self.speculator.switch
        self.step_times = switch and switch.times  # measured at startup; None off CUDA
        observe = self.speculator.observe

        def observe_judged(num_drafts: int, num_accepted: int) -> None:
            self.judged += num_accepted + (num_accepted < num_drafts)
            observe(num_drafts, num_accepted)

        self.speculator.observe = observe_judged
        self.draft_oracle: OracleProposer | None = None  # see run()
        self.drafter = getattr(self.engine.core.runner.speculation, "drafter", None)
        if self.drafter is not None:
            fill = self.drafter.fill
            self.drafter.fill = lambda seqs, *rest: self._oracle_drafts(seqs, fill(seqs, *rest))

    def _oracle_drafts(self, seqs: list[ScheduledSequence], drafts: torch.Tensor
                       ) -> torch.Tensor:
        """The draft model's drafts as it made them (its whole cost), then swapped for the
        oracle's: the acceptance rate is set, the draft's cost is real. The draft's KV keeps
        its own tokens there, which changes what it drafts next, never the output."""
        if self.draft_oracle is None:
            return drafts
        swapped = np.full(drafts.shape, NO_TOKEN, dtype=np.int64)
        for row, s in enumerate(seqs):
            if s.num_drafts:
                swapped[row, :s.num_drafts] = self.draft_oracle.drafts_at(
                    s.request_id, s.num_output_tokens, s.num_drafts)
        return upload(swapped, torch.int64, drafts.device)

    def configure(self, k: int, proposer=None, adaptive: bool = False) -> None:
        """Draft up to k; `adaptive`: through a fresh switch-off (the engine's default, its
        acceptance estimate back at the prior), else every step drafts k."""
        self.speculator.max_k = k
        self.speculator.proposer = proposer or self.speculator.proposer
        self.speculator.switch = (SpeculationSwitch(self.step_times)
                                  if adaptive and self.step_times else None)

    def run(self, prompts: list[list[int]], references: list[list[int]] | None = None,
            rate: float = 0.0, seed: int | None = None) -> tuple[list, float]:
        """Greedy outputs of the prompts and the wall seconds; with references, the oracle
        replays them at acceptance rate `rate` (in place of the draft model's tokens, for
        the draft_model method), its corruptions drawn from `seed` and the prompt's index
        (None: a seed of its own for each run)."""
        ids = [f"b{self._next + i}" for i in range(len(prompts))]
        self._next += len(prompts)
        self.draft_oracle = None
        if references is not None:
            oracle = OracleProposer(rate, VOCAB, seed=self._next if seed is None else seed)
            for i, (request_id, reference) in enumerate(zip(ids, references)):
                oracle.add(f"{request_id}#0", reference, key=str(i))
            if self.drafter is None:
                self.speculator.proposer = oracle
            else:  # the draft model still drafts (and costs); the oracle sets the tokens
                self.draft_oracle = oracle
        params = SamplingParams(temperature=0.0, max_tokens=self.args.output_len,
                                ignore_eos=True)
        start = time.perf_counter()
        for request_id, prompt in zip(ids, prompts):
            self.engine.add_request(request_id, prompt, params)
        done = {}
        while len(done) < len(ids):
            done.update({o.request_id: o for o in self.engine.step() if o.finished})
        return [done[i] for i in ids], time.perf_counter() - start

    def counters(self) -> dict:
        stats = self.speculator.stats
        return {"drafts": stats.num_drafts, "draft_tokens": stats.num_draft_tokens,
                "accepted": stats.num_accepted_tokens, "judged": self.judged}


def first_divergence(speculative: list[int], plain: list[int]) -> int | None:
    """Where speculation's greedy output first left plain decoding's (None: identical). On a
    GPU in fp16 a verification step's shapes can round a near-tie differently from a decode
    step's (vLLM documents the same limit), so a run records it, warns, and goes on; the CPU
    tests (fp32) demand None everywhere."""
    position = next((i for i, (s, p) in enumerate(zip_longest(speculative, plain)) if s != p),
                    None)
    if position is not None:
        print(f"warning: speculation changed the greedy output at token {position}",
              flush=True)
    return position


def decode_seconds_per_token(output) -> float:
    """One stream's decode time per token after its first."""
    metrics = output.metrics[0]
    return (metrics.finish_time - metrics.first_token_time) / (len(output.token_ids) - 1)


def acceptance(before: dict, after: dict) -> dict:
    """Counters over a run: accepted / drafted, and a = accepted / judged, which the oracle
    must reproduce."""
    d = {name: after[name] - before[name] for name in after}
    return {"accepted_over_drafted": d["accepted"] / max(d["draft_tokens"], 1),
            "a_measured": d["accepted"] / max(d["judged"], 1),
            "mean_accepted_length": 1 + d["accepted"] / max(d["drafts"], 1)}


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB - 1) for _ in range(n)]
