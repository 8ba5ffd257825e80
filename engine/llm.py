"""LLMEngine (add_request / step / abort, used by the server) and the offline `LLM` facade.

    LLMEngine.step():
        Scheduler.schedule() -> SchedulerOutput -> ModelRunner.execute() -> RunnerOutput
        Scheduler.update()   -> requests with new tokens -> text, stop strings -> RequestOutputs

A request with n > 1 runs as n sequences ("{id}#{i}") that share the prompt's cached blocks.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Sequence

from engine.core.block_manager import BlockManager
from engine.core.config import EngineConfig, load_config
from engine.output.detokenize import TextStream
from engine.output.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.core.request import Request, RequestStatus, SamplingParams
from engine.core.scheduler import Scheduler
from engine.output.tokenizer import Tokenizer

log = logging.getLogger(__name__)

Prompt = str | list[int]


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_free_blocks: int
    num_total_blocks: int


class _Choice:
    """Output state of one of a request's n sequences."""

    def __init__(self, index: int, request: Request, tokenizer: Tokenizer) -> None:
        self.index = index
        self.request = request
        self.stream = TextStream(tokenizer, request.params.stop,
                                 final_only=request.params.output_kind == "final_only")
        self.output = CompletionOutput(index=index,
                                       logprobs=[] if request.params.logprobs is not None
                                       else None)
        # final_only without stop strings or logprobs: nothing to see or check per token
        self.defers_tokens = self.stream.decodes_at_end and self.output.logprobs is None

    def snapshot(self) -> CompletionOutput:
        """A copy the caller may keep while this choice goes on growing."""
        out = self.output
        return CompletionOutput(
            out.index, out.text, list(out.token_ids),
            None if out.logprobs is None else list(out.logprobs), out.finish_reason,
            out.stop_reason, out.delta_text, out.delta_token_ids, out.delta_logprobs)


@dataclass
class _Group:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    choices: list[_Choice]
    error: str | None = None  # set when handling this request's output raised

    @property
    def finished(self) -> bool:
        return all(c.output.finish_reason is not None for c in self.choices)

    def to_output(self) -> RequestOutput:
        # positional: keyword arguments cost ~2 us more, per request per streamed step
        metrics = [RequestMetrics(c.request.arrival_time, c.request.first_scheduled_time,
                                  c.request.first_token_time, c.request.token_times,
                                  c.request.finish_time, c.request.num_cached_tokens)
                   for c in self.choices]
        outputs = [c.snapshot() for c in self.choices]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs,
                             metrics, self.error)


class LLMEngine:
    def __init__(self, config: EngineConfig, runner=None) -> None:
        """`runner` defaults to a ModelRunner for the config; tests pass a fake with the same
        `num_kv_blocks` and `launch(SchedulerOutput) -> pending with .wait()`."""
        if runner is None:
            from engine.worker.model_runner import ModelRunner  # torch lives behind this import

            runner = ModelRunner(config)
        self.config = config
        self.tokenizer = Tokenizer()
        self.runner = runner
        self.block_manager = BlockManager(self.runner.num_kv_blocks, config.cache.block_size,
                                          config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self._groups: dict[str, _Group] = {}
        self._choice_of: dict[str, tuple[_Group, _Choice]] = {}  # sequence id -> owner
        self._in_flight = None  # (SchedulerOutput, pending result) of the launched step

    # ------------------------------------------------------------------ intake
    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        """Validate and queue a request. Raises ValueError with a clear message on bad input."""
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids = self._tokenize(prompt)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        group = _Group(request_id, prompt if isinstance(prompt, str) else None, token_ids, [])
        for i in range(params.n):
            # choices of a seeded request get distinct, still reproducible, seeds
            seq_params = params if params.seed is None else replace(params, seed=params.seed + i)
            seq = Request(f"{request_id}#{i}", list(token_ids), seq_params, arrival_time=arrival)
            group.choices.append(_Choice(i, seq, self.tokenizer))
        for choice in group.choices:  # all choices pass the same checks: the first raises
            self.scheduler.add(choice.request)
            self._choice_of[choice.request.request_id] = (group, choice)
        self._groups[request_id] = group

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
            vocab = self.tokenizer.vocab_size
            bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab),
                       None)
            if bad is not None:
                raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        return token_ids

    def abort(self, request_id: str) -> None:
        """Finish the request now and free its KV blocks. Unknown ids are ignored."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return
        for choice in group.choices:
            self.scheduler.finish(choice.request.request_id, RequestStatus.FINISHED_ABORTED)
            self._choice_of.pop(choice.request.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    # -------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """One engine iteration. Step N+1 is scheduled and launched before step N's tokens
        are waited for, so the host's scheduling, input staging and output handling overlap
        the device's work instead of idling it:

            host:    schedule N+1 ─▶ launch N+1 ─▶ wait N ─▶ update N ─▶ outputs of N
            device:  ──── step N ────────────────┘└──── step N+1 ─────────────────────
                                                   (outputs: detokenize, stop strings)

        Tokens N samples that N+1 needs as input are placeholders the runner fills on the
        device (see Scheduler). A request that step N ends (EOS, a stop string) may have one
        wasted token of compute in N+1, whose result update drops. With async_scheduling off,
        each step is waited for and applied before step() returns."""
        scheduled = self.scheduler.schedule()
        launched = None if scheduled.is_empty else (scheduled, self.runner.launch(scheduled))
        to_finish = launched
        if self.config.scheduler.async_scheduling:
            to_finish, self._in_flight = self._in_flight, launched
        if to_finish is None:
            return []
        scheduled, pending = to_finish
        result = pending.wait()
        logprobs = dict(zip(result.request_ids, result.logprobs)) if any(result.logprobs) else {}
        return self._process([(request, logprobs.get(request.request_id))
                              for request in self.scheduler.update(scheduled, result)])

    def _process(self, sampled: list) -> list[RequestOutput]:
        changed: dict[str, _Group] = {}
        for request, token_logprobs in sampled:
            owner = self._choice_of.get(request.request_id)
            if owner is None or owner[1].request is not request:
                continue  # aborted since its token was sampled (its id may be reused since)
            group, choice = owner
            finished = request.status.is_finished
            if choice.defers_tokens and not finished:
                continue  # nothing of it is read before the end: its tokens are applied then
            try:
                new_tokens = request.output_token_ids[len(choice.output.token_ids):]
                for i, token in enumerate(new_tokens, 1):
                    self._apply_token(choice, token, token_logprobs,
                                      final=finished and i == len(new_tokens))
            except Exception as err:  # one request's failure must not take down the others
                log.exception("request %s failed while handling its output", group.request_id)
                self._fail(group, f"{type(err).__name__}: {err}")
            if (request.params.output_kind == "stream" or group.error is not None
                    or (request.status.is_finished and group.finished)):
                changed[group.request_id] = group
        return [self._emit(group) for group in changed.values()]

    def _fail(self, group: _Group, message: str) -> None:
        """End every choice of the group now (blocks freed); its output carries the error."""
        group.error = message
        for choice in group.choices:
            self.scheduler.finish(choice.request.request_id, RequestStatus.FINISHED_ABORTED)
            if choice.output.finish_reason is None:
                choice.output.finish_reason = RequestStatus.FINISHED_ABORTED.value

    def _apply_token(self, choice: _Choice, token: int, token_logprobs, final: bool) -> None:
        """Append one token to the choice's output; `final`: the request's last token."""
        request, out = choice.request, choice.output
        out.delta_text += choice.stream.add(token, final=final)
        out.delta_token_ids.append(token)
        out.token_ids.append(token)
        if out.logprobs is not None and token_logprobs is not None:
            out.logprobs.append(token_logprobs)
            out.delta_logprobs = (out.delta_logprobs or []) + [token_logprobs]
        if choice.stream.stopped_by is not None:
            # a stop string wins even when the same token also hit max_tokens (as in vLLM)
            if not final:
                self.scheduler.finish(request.request_id, RequestStatus.FINISHED_STOPPED,
                                      choice.stream.stopped_by)
            out.finish_reason = RequestStatus.FINISHED_STOPPED.value
            out.stop_reason = choice.stream.stopped_by
        elif final:
            out.finish_reason = request.status.value
            out.stop_reason = request.stop_reason
        out.text = choice.stream.text

    def _emit(self, group: _Group) -> RequestOutput:
        """Snapshot the group's outputs, then reset the per-step deltas."""
        output = group.to_output()
        for choice in group.choices:  # the snapshot took the delta lists: start new ones
            choice.output.delta_text = ""
            choice.output.delta_token_ids = []
            choice.output.delta_logprobs = None
        if output.finished:  # a failed group is finished too: _fail ended every choice
            self._groups.pop(group.request_id, None)
            for choice in group.choices:
                self._choice_of.pop(choice.request.request_id, None)
        return output

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(num_running=len(self.scheduler.running),
                           num_waiting=len(self.scheduler.waiting),
                           kv_cache_usage=bm.usage, prefix_cache_queries=bm.prefix_queries,
                           prefix_cache_hits=bm.prefix_hits,
                           num_preemptions=self.scheduler.num_preemptions,
                           num_free_blocks=bm.num_free_blocks, num_total_blocks=bm.num_blocks)


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
        # only finished outputs are kept here: skip building per-step outputs
        params_list = [replace(p, output_kind="final_only") for p in params_list]
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        ids = []
        for prompt, p in zip(prompts, params_list):
            ids.append(str(self._next_id))
            self._next_id += 1
            self.engine.add_request(ids[-1], prompt, p)
        return self._run(ids, use_tqdm)

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


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt of token ids
    return prompts
