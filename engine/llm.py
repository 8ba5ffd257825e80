"""LLMEngine (add_request / step / abort in one process) and the offline `LLM` facade.

    LLMEngine.step():
        EngineCore.step()          schedule -> runner -> update -> StepOutput (token ids)
        OutputProcessor.process()  -> text, stop strings -> RequestOutputs

A request with n > 1 runs as n sequences ("{id}#{i}") that share the prompt's cached blocks;
a beam search runs as one request of the core, whose results are its n choices
(engine/beam_search.py).
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Sequence

from engine.beam_search import (BeamSearchOutput, BeamSearchParams, BeamSearchSequence,
                                beam_search_requests, beam_sequences, search_params)
from engine.core.block_manager import BlockManager
from engine.core.config import EngineConfig, load_config
from engine.build import build_engine_core
from engine.core.messages import ENGINE_COUNTERS, EngineStats
from engine.core.request import SamplingParams
from engine.core.scheduler import Scheduler
from engine.output.outputs import RequestOutput
from engine.output.processor import OutputProcessor
from engine.output.tokenizer import Tokenizer
from engine.speculative.stats import Counter, Vector
from engine.speculative.switch import StepTimes
from engine.structured.grammar import check as check_structured_outputs

Prompt = str | list[int]


class LLMEngine:
    """Tokenizer, OutputProcessor and EngineCore in one process, stepped by the caller; the
    server runs the same two halves in two processes (server/core_main.py)."""

    def __init__(self, config: EngineConfig, runner=None,
                 step_times: StepTimes | None = None) -> None:
        """`runner` and `step_times`: see engine.build.build_engine_core."""
        self.config = config
        self.tokenizer = Tokenizer()
        self.core = build_engine_core(config, runner, step_times)
        self.processor = OutputProcessor(self.tokenizer)

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                    arrival_time: float | None = None, cache_salt: str | None = None) -> None:
        """Validate and queue a request; ValueError on bad input. cache_salt: see
        OutputProcessor.add."""
        if params.structured_outputs is not None:
            check_structured_outputs(params.structured_outputs)
        token_ids = self.tokenizer.encode_prompt(prompt)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        sequences = self.processor.add(request_id, prompt if isinstance(prompt, str) else None,
                                       token_ids, params, arrival, cache_salt=cache_salt)
        try:
            for seq in sequences:
                self.core.add(seq)
        except ValueError:
            self.processor.abort(request_id)
            raise

    def add_beam_search(self, request_id: str, prompt: Prompt, params: BeamSearchParams,
                        arrival_time: float | None = None) -> None:
        """Queue a beam search; ValueError on bad input, or if it can never run. Its
        RequestOutput's choices are its results, best first (`beam_sequences` reads them)."""
        token_ids = self.tokenizer.encode_prompt(prompt)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        choices = self.processor.add(request_id, prompt if isinstance(prompt, str) else None,
                                     token_ids, search_params(params), arrival)
        try:
            self.core.add(beam_search_requests(choices, [params])[0])
        except ValueError:
            self.processor.abort(request_id)
            raise

    def abort(self, request_id: str) -> None:
        """Finish the request now and free its KV blocks. Unknown ids are ignored."""
        self.core.abort(self.processor.abort(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.processor.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One engine iteration (see EngineCore.step); a stop string found in this step's
        text aborts its sequence in the core."""
        outputs, to_abort = self.processor.process(self.core.step())
        self.core.abort(to_abort)
        if self.core.failed:  # a grammar that passed its check but did not compile
            failed, self.core.failed = self.core.failed, []
            for failure in failed:
                self.processor.abort(failure.seq_id.rsplit("#", 1)[0])
            raise RuntimeError("; ".join(f"{f.seq_id}: {f.message}" for f in failed))
        return outputs

    def stats(self) -> EngineStats:
        return self.core.stats()

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def block_manager(self) -> BlockManager:
        return self.core.block_manager

    @property
    def runner(self):
        return self.core.runner


class LLM:
    """Offline batch generation: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str = "gpt2", config_file: str | None = None, **overrides) -> None:
        self.engine = LLMEngine(load_config(config_file, model=model, **overrides))
        self._next_id = 0

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Outputs in the order of the prompts. A single prompt may be given bare."""
        prompts = _as_prompt_list(prompts)
        params = sampling_params or SamplingParams()
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else params
        params_list = [replace(p, output_kind="final_only") for p in params_list]
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        ids = []
        for prompt, p in zip(prompts, params_list):
            ids.append(str(self._next_id))
            self._next_id += 1
            self.engine.add_request(ids[-1], prompt, p)
        return self._run(ids, use_tqdm)

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's offline beam search: one BeamSearchOutput per prompt, in order; all prompts'
        searches run together in the engine core. A sequence's `text` includes the prompt's
        (as vLLM's), not a final EOS. ValueError, with nothing queued, if a prompt plus
        max_tokens cannot fit the context or a search the pool."""
        ids = []
        try:
            for prompt in _as_prompt_list(prompts):
                ids.append(str(self._next_id))
                self._next_id += 1
                self.engine.add_beam_search(ids[-1], prompt, params)
        except ValueError:
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        return [BeamSearchOutput(self._with_text(beam_sequences(output, params)))
                for output in self._run(ids, use_tqdm)]

    def _with_text(self, sequences: list[BeamSearchSequence]) -> list[BeamSearchSequence]:
        for seq in sequences:
            seq.text = self.engine.tokenizer.decode(seq.text_token_ids(with_prompt=True))
        return sequences

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm import tqdm

        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while len(done) < len(ids):
                for output in self.engine.step():
                    if output.finished:
                        done[output.request_id] = output
                        bar.update(1)
        return [done[i] for i in ids]

    def get_metrics(self) -> list[Counter | Vector]:
        """vLLM's offline accessor: the cumulative counters under vLLM's names."""
        stats = self.engine.stats()
        counters = [Counter(f"vllm:{name}", getattr(stats, name)) for name in ENGINE_COUNTERS]
        speculator = self.engine.core.speculator
        return counters + ([] if speculator is None else speculator.stats.metrics())


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt of token ids
    return prompts
