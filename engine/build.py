"""Puts the engine together from a config, in the order a reader follows:

    build_runner    load the model ─▶ size the KV cache ─▶ add speculation ─▶ capture graphs
    build_engine_core   the grammars of structured outputs (their processes start first), a
                        runner, the speculator (its switch-off timed on the runner), the core

The only module that wires engine/worker/ and engine/speculative/ into engine/core/: the
core and the worker know speculation only through their small protocols.
"""
from __future__ import annotations

import logging
import time

from engine.core.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.cpus import usable_cpus
from engine.speculative.speculator import build_speculator
from engine.speculative.switch import StepTimes
from engine.structured.manager import StructuredOutputs
from engine.structured.process import GrammarProcess

log = logging.getLogger(__name__)


def build_runner(config: EngineConfig):
    """A ModelRunner ready to launch steps (torch is imported here, not before)."""
    from engine.speculative.draft_model.method import build_draft, draft_memory, find_draft
    from engine.speculative.host_drafts import HostDraftSpeculation
    from engine.worker.kv_sizing import KVSizing
    from engine.worker.model_runner import ModelRunner
    from engine.worker.models.gpt2 import find_checkpoint

    model_dir, model_config = find_checkpoint(config.model.model)
    draft = find_draft(config, model_dir)  # checked against the target before any load
    runner = ModelRunner(config, model_dir, model_config)
    if config.speculative is not None:  # the worst-case step samples at every draft
        runner.speculation = HostDraftSpeculation(runner.device)
    start = time.perf_counter()
    extra = (0, 0) if draft is None else draft_memory(
        draft.config, runner.block_size, runner.dtype, config.scheduler.max_num_seqs,
        config.model.quantization)
    num_blocks, sizing = ((config.cache.num_kv_blocks, "given") if config.cache.num_kv_blocks
                          else KVSizing(runner, *extra).num_blocks())
    runner.allocate(num_blocks)
    runner.startup.add("KV sizing", time.perf_counter() - start, sizing)
    log.info("KV cache: %d blocks of %d tokens (%.2f GiB); %.1f requests fit at the full "
             "%d-token context; sized in %.1f s", num_blocks, runner.block_size,
             num_blocks * runner.kv_block_bytes / 2**30, num_blocks / runner.max_blocks_per_seq,
             config.scheduler.max_model_len, time.perf_counter() - start)
    if draft is not None:
        runner.speculation = build_draft(config, runner, draft)
    if runner.uses_graphs:
        runner.capture_graphs()
    return runner


def build_engine_core(config: EngineConfig, runner=None,
                      step_times: StepTimes | None = None) -> EngineCore:
    """The core over `runner` (default: build_runner; tests pass fakes, grammars in-process).
    The switch-off decides from `step_times`, timed on a built runner's CUDA device; without
    them every step speculates. Building the runner, the grammars come first: on CUDA their
    child processes spend seconds of CPU importing xgrammar, which then overlap the model's
    load and graph capture instead of the first requests served."""
    if runner is not None:
        return EngineCore(config, runner, build_speculator(config, step_times),
                          build_grammars(config, None))
    from engine.worker.device import resolve_device

    grammars = build_grammars(config, resolve_device(config.model.device))
    try:
        runner = build_runner(config)
        step_times = measured_step_times(config, runner)
    except BaseException:
        if isinstance(grammars, GrammarProcess):  # its children end with their sockets
            grammars.close()
        raise
    return EngineCore(config, runner, build_speculator(config, step_times), grammars)


def build_grammars(config: EngineConfig, device) -> StructuredOutputs | GrammarProcess:
    """On CUDA grammars live in a child process, so mask fills overlap the core's thread;
    elsewhere in-process (a child takes seconds to import xgrammar; a CPU forward dwarfs a
    fill)."""
    max_rows = config.scheduler.max_num_seqs
    if getattr(device, "type", None) == "cuda":
        # children share a large mask, on cores the core's loop leaves idle; 4 fill 64 rows
        # of a JSON schema (~17 us a row) within one step's host time, at ~0.4 GB each
        children = max(1, min(4, int(usable_cpus()) - 2))
        return GrammarProcess(max_rows, children, pin=True)
    return StructuredOutputs(max_rows)


def measured_step_times(config: EngineConfig, runner) -> StepTimes | None:
    spec = config.speculative
    if spec is None:
        return None
    if not spec.adaptive or runner.device.type != "cuda":
        log.info("speculation: every step drafts %d tokens (%s)", spec.num_speculative_tokens,
                 "adaptive is false" if not spec.adaptive else "no switch-off off CUDA")
        return None
    from engine.speculative.switch import verdict
    from engine.speculative.timing import measure_step_times

    start = time.perf_counter()
    times = measure_step_times(runner, spec, config.scheduler)
    log.info("speculation cost model measured in %.1f s: %s", time.perf_counter() - start,
             times)
    log.info("%s (the switch-off turns it on and off by the acceptance it observes; "
             "speculative_config adaptive=false drafts every step)", verdict(times))
    return times
