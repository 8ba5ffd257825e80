"""Prometheus metrics under vLLM's names (`vllm:` prefix, `model_name` label), so dashboards
built for vLLM work unchanged.

Each app owns a CollectorRegistry (several apps in one process never collide), fed by:
  * `observe_request` / `observe_output`, per admitted request and delivered RequestOutput:
    token counters and per-request histograms (inter-token latency: one sample per token);
  * `observe_stats`, per engine iteration: gauges, the iteration's scheduled tokens, and the
    engine's cumulative counters as Prometheus increments.
Feeds, `flush` and `render` all run on the event loop, so the values held back need no lock.
Every histogram and the token counters keep what they are fed in plain Python
(BatchedHistogram, BatchedCounter) until `flush` hands it to prometheus_client, which then
exports what one `observe`/`inc` per value would (a histogram's sum up to float rounding).
EngineClient flushes at the end of every batch of engine steps (an idle core still sends
one every 0.2 s) and `render` flushes before it reads, so a scrape sees every value this
process has been given; another API server's values reach it at that server's next flush,
at most one batch of engine steps late. Gauges and the engine's counters are written at once.

With several API servers (server/api_servers.py) each process writes its values to
PROMETHEUS_MULTIPROC_DIR and /metrics on any of them reads every process's: request counters
and histograms sum, gauges show the most recent write, and only API server 0 turns the
engine's cumulative counts into increments (each server sees the same counts).
"""
from __future__ import annotations

import os
import time
from bisect import bisect_right
from operator import attrgetter, sub
from typing import Any

from prometheus_client import (CollectorRegistry, Counter, Gauge, GCCollector, Histogram,
                               PlatformCollector, ProcessCollector, generate_latest)
from prometheus_client.multiprocess import MultiProcessCollector

from engine.core.config import CacheConfig
from engine.core.messages import ENGINE_COUNTERS, EngineStats, SpecCounts
from engine.core.request import SamplingParams
from engine.output.outputs import RequestMetrics, RequestOutput

PREFIX = "vllm:"
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
N_BUCKETS = [1, 2, 5, 10, 20]  # vLLM's for request_params_n
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
SUCCESS_REASONS = ("stop", "length")  # the finish reasons vllm:request_success counts
_delta_token_ids = attrgetter("delta_token_ids")


def one_two_five_buckets(maximum: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to maximum: vLLM's buckets for token counts."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > maximum:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


def cache_config_labels(cache: CacheConfig, num_gpu_blocks: int) -> dict[str, str]:
    """vllm:cache_config_info's labels: every cache setting as text (str(), as vLLM writes
    them), under vLLM's names where it has the setting; `num_gpu_blocks` is the pool the
    engine sized (on CPU too, as in vLLM). The KV cache is kept in the model's dtype: vLLM's
    cache_dtype "auto". `engine` is vLLM's engine index: one engine core here."""
    return {"block_size": str(cache.block_size), "cache_dtype": "auto",
            "enable_prefix_caching": str(cache.enable_prefix_caching),
            "gpu_memory_utilization": str(cache.gpu_memory_utilization),
            "num_gpu_blocks": str(num_gpu_blocks),
            "num_gpu_blocks_override": str(cache.num_kv_blocks),
            "cpu_kv_cache_bytes": str(cache.cpu_kv_cache_bytes), "engine": "0"}


class BatchedCounter:
    """A Counter child fed in batches: its owner adds to `total`, a plain number that only
    grows, and `flush` increments the child by what `total` gained since the last flush."""
    __slots__ = ("child", "total", "flushed")

    def __init__(self, child: Any) -> None:
        self.child = child
        self.total = 0
        self.flushed = 0  # the part of total the child has

    def flush(self) -> None:
        if self.total != self.flushed:
            self.child.inc(self.total - self.flushed)
            self.flushed = self.total


class BatchedHistogram:
    """A Histogram child fed in batches: `observe` (one value) and `observe_all` (an iterable)
    are the sample list's own append and extend, so observing runs no Python code, and
    `flush` adds the samples to the child's buckets and sum at once. It writes the child's
    `_buckets` (one non-cumulative count per upper bound, +Inf last; a value goes to the
    first bound it does not exceed) and `_sum`: prometheus_client's Histogram layout, which
    tests/server/test_metrics.py checks through the exported text."""
    __slots__ = ("child", "samples", "observe", "observe_all")

    def __init__(self, child: Any) -> None:
        self.child = child
        self.samples: list[float] = []
        self.observe = self.samples.append
        self.observe_all = self.samples.extend

    def flush(self) -> None:
        samples = self.samples
        total, ordered = sum(samples), sorted(samples)
        samples.clear()
        below = 0
        for bound, bucket in zip(self.child._upper_bounds, self.child._buckets):
            upto = bisect_right(ordered, bound)  # the samples <= bound
            if upto > below:
                bucket.inc(upto - below)
                below = upto
        self.child._sum.inc(total)


class ServerMetrics:
    def __init__(self, model_name: str, max_model_len: int,
                 counts_engine_totals: bool = True,
                 cache_config_info: dict[str, str] | None = None) -> None:
        """`counts_engine_totals`: this process exports the engine's cumulative counters and
        per-iteration tokens (False on all API servers but one, which see the same steps).
        `cache_config_info`: vllm:cache_config_info's labels (cache_config_labels); None
        leaves that family out."""
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.counts_engine_totals = counts_engine_totals
        self._engine_totals = dict.fromkeys(ENGINE_COUNTERS, 0)
        self._histograms: list[BatchedHistogram] = []  # every one _histogram made
        self._successes = dict.fromkeys(SUCCESS_REASONS, 0)  # requests since the last flush
        tokens = one_two_five_buckets(max_model_len)
        self.ttft = self._histogram("time_to_first_token_seconds",
                                    "Time to first token", TTFT_BUCKETS)
        self.itl = self._histogram("inter_token_latency_seconds",
                                   "Time between consecutive output tokens", ITL_BUCKETS)
        self.e2e = self._histogram("e2e_request_latency_seconds",
                                   "Arrival to finish", LATENCY_BUCKETS)
        self.queue_time = self._histogram("request_queue_time_seconds",
                                          "Arrival to first scheduled", LATENCY_BUCKETS)
        self.prefill_time = self._histogram("request_prefill_time_seconds",
                                            "First scheduled to first token", LATENCY_BUCKETS)
        self.decode_time = self._histogram("request_decode_time_seconds",
                                           "First token to finish", LATENCY_BUCKETS)
        self.inference_time = self._histogram("request_inference_time_seconds",
                                              "First scheduled to finish", LATENCY_BUCKETS)
        self.params_n = self._histogram("request_params_n", "The request's n", N_BUCKETS)
        self.params_max_tokens = self._histogram("request_params_max_tokens",
                                                 "The request's max_tokens", tokens)
        self.prompt_len = self._histogram("request_prompt_tokens", "Prompt length", tokens)
        self.generation_len = self._histogram("request_generation_tokens",
                                              "Tokens generated per request", tokens)
        self.running = self._gauge("num_requests_running", "Sequences running")
        self.waiting = self._gauge("num_requests_waiting", "Sequences waiting")
        self.kv_usage = self._gauge("kv_cache_usage_perc", "KV-cache usage, 1 is full")
        # their totals also feed the periodic log line (ThroughputLog)
        self.prompt_tokens = BatchedCounter(self._counter("prompt_tokens",
                                                          "Prompt tokens processed"))
        self.generation_tokens = BatchedCounter(self._counter("generation_tokens",
                                                              "Tokens generated"))
        self.request_success = Counter(PREFIX + "request_success", "Finished requests",
                                       ["model_name", "finished_reason"], registry=self.registry)
        self.engine_counters = {name: self._counter(name, name.replace("_", " "))
                                for name in ENGINE_COUNTERS}
        self.iteration_tokens = self._histogram("iteration_tokens_total",
                                                "Histogram of number of tokens per engine_step.",
                                                ITERATION_TOKENS_BUCKETS)
        if cache_config_info is not None:
            Gauge(PREFIX + "cache_config_info", "Information of the LLMEngine CacheConfig",
                  list(cache_config_info), registry=self.registry,
                  multiprocess_mode="mostrecent").labels(**cache_config_info).set(1)
        self.spec: SpecMetrics | None = None  # registered once the engine reports speculating
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=self.registry)  # process_*, python_* as vLLM exports them

    def _histogram(self, name: str, doc: str, buckets: list[Any]) -> BatchedHistogram:
        histogram = BatchedHistogram(Histogram(PREFIX + name, doc, ["model_name"],
                                               buckets=buckets, registry=self.registry
                                               ).labels(self.model_name))
        self._histograms.append(histogram)
        return histogram

    def _gauge(self, name: str, doc: str) -> Any:
        return Gauge(PREFIX + name, doc, ["model_name"], registry=self.registry,
                     multiprocess_mode="mostrecent").labels(self.model_name)

    def _counter(self, name: str, doc: str) -> Any:
        return Counter(PREFIX + name, doc, ["model_name"],
                       registry=self.registry).labels(self.model_name)

    def observe_request(self, params: SamplingParams) -> None:
        """The sampling parameters of one admitted engine request (a prompt)."""
        self.params_n.observe(params.n)
        self.params_max_tokens.observe(params.max_tokens)

    def observe_output(self, output: RequestOutput, first: bool) -> None:
        """Count tokens as they stream; record latencies when the request finishes."""
        if first:
            self.prompt_tokens.total += len(output.prompt_token_ids)
        self.generation_tokens.total += sum(map(len, map(_delta_token_ids, output.outputs)))
        if output.finished:
            self._observe_finished(output)

    def _observe_finished(self, output: RequestOutput) -> None:
        self.prompt_len.observe(len(output.prompt_token_ids))
        for choice, timing in zip(output.outputs, output.metrics):
            self.generation_len.observe(len(choice.token_ids))
            if choice.finish_reason in self._successes:
                self._successes[choice.finish_reason] += 1
            self._observe_timing(timing)

    def _observe_timing(self, timing: RequestMetrics) -> None:
        """vLLM's phases: queued (arrival to first scheduled), prefill (to the first token),
        decode (first token to finish) and inference (first scheduled to finish)."""
        scheduled, first, done = (timing.first_scheduled_time, timing.first_token_time,
                                  timing.finish_time)
        if scheduled is not None:
            self.queue_time.observe(scheduled - timing.arrival_time)
        if first is not None:
            self.ttft.observe(first - timing.arrival_time)
        times = timing.token_times
        self.itl.observe_all(map(sub, times[1:], times))
        if done is not None:
            self.e2e.observe(done - timing.arrival_time)
        if scheduled is not None and first is not None:
            self.prefill_time.observe(first - scheduled)
        if first is not None and done is not None:
            self.decode_time.observe(done - first)
        if scheduled is not None and done is not None:
            self.inference_time.observe(done - scheduled)

    def observe_stats(self, stats: EngineStats) -> None:
        """Gauges from the engine's snapshot; its cumulative counts become increments; the
        tokens of the step it scheduled (if any) join the histogram. Called once per step."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        if not self.counts_engine_totals:
            return
        if stats.num_scheduled_tokens:
            self.iteration_tokens.observe(stats.num_scheduled_tokens)
        for name in ENGINE_COUNTERS:
            total = getattr(stats, name)
            if total > self._engine_totals[name]:
                self.engine_counters[name].inc(total - self._engine_totals[name])
            self._engine_totals[name] = total
        if stats.spec is not None:
            if self.spec is None:
                self.spec = SpecMetrics(self.registry, self.model_name)
            self.spec.observe(stats.spec)

    def flush(self) -> None:
        """Hand every batched value observed since the last flush to prometheus_client."""
        for histogram in self._histograms:
            if histogram.samples:  # most have none: no call for those
                histogram.flush()
        self.prompt_tokens.flush()
        self.generation_tokens.flush()
        for reason, count in self._successes.items():
            if count:
                self.request_success.labels(self.model_name, reason).inc(count)
                self._successes[reason] = 0

    def render(self) -> bytes:
        """This app's families and its process's (process_*, python_*); with several API
        servers, every server's app families summed (prometheus-client's multiprocess mode
        has no process families). Flushes first."""
        self.flush()
        if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
            return generate_latest(self.registry)
        every_process = CollectorRegistry()
        MultiProcessCollector(every_process)
        return generate_latest(every_process)


class SpecMetrics:
    """vLLM's speculative decoding counters (engine/speculative/stats.py), from the engine's
    cumulative counts."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        self.counters = {name: Counter(f"{PREFIX}spec_decode_{name}", name.replace("_", " "),
                                       ["model_name"], registry=registry)
                         for name in SPEC_COUNTERS}
        # ours, not vLLM's: the draft length the switch-off chose for the latest step
        self.draft_length = Gauge("gpt2serve:spec_decode_draft_length",
                                  "Tokens drafted per sequence in the latest step (0: the "
                                  "speculation switch-off turned it off)", ["model_name"],
                                  registry=registry, multiprocess_mode="mostrecent"
                                  ).labels(model_name)
        self.per_pos = Counter(f"{PREFIX}spec_decode_num_accepted_tokens_per_pos",
                               "Steps whose draft at this position was accepted",
                               ["model_name", "position"], registry=registry)
        self.totals = SpecCounts(0, 0, 0, [])

    def observe(self, counts: SpecCounts) -> None:
        self.draft_length.set(counts.draft_length)
        for name in SPEC_COUNTERS:
            new = getattr(counts, name) - getattr(self.totals, name)
            self.counters[name].labels(self.model_name).inc(max(0, new))
        before = self.totals.num_accepted_tokens_per_pos
        for position, total in enumerate(counts.num_accepted_tokens_per_pos):
            new = total - (before[position] if position < len(before) else 0)
            self.per_pos.labels(self.model_name, str(position)).inc(max(0, new))
        self.totals = counts


def spec_summary(counts: SpecCounts) -> str:
    """Acceptance rate and mean accepted length (tokens a speculating row gains a step)."""
    rate = counts.num_accepted_tokens / max(counts.num_draft_tokens, 1)
    length = 1 + counts.num_accepted_tokens / max(counts.num_drafts, 1)
    return f"spec acceptance rate {rate:.1%}, mean accepted length {length:.2f}"


class ThroughputLog:
    """Builds the periodic log line: token rates since the previous line, queue and KV use."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self._last = (time.monotonic(), 0, 0)

    def line(self, stats: EngineStats, server_waiting: int, core_silence: float) -> str:
        now = time.monotonic()
        prompt, generation = (self.metrics.prompt_tokens.total,
                              self.metrics.generation_tokens.total)
        then, last_prompt, last_generation = self._last
        self._last = (now, prompt, generation)
        elapsed = max(now - then, 1e-9)
        hit_rate = stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1)
        return (f"prompt throughput {(prompt - last_prompt) / elapsed:.1f} tok/s, "
                f"generation throughput {(generation - last_generation) / elapsed:.1f} tok/s, "
                f"running {stats.num_running}, waiting {stats.num_waiting} "
                f"(server queue {server_waiting}), KV cache {stats.kv_cache_usage:.1%}, "
                f"prefix hit rate {hit_rate:.1%}, preemptions {stats.num_preemptions}, "
                f"core silent {core_silence:.1f} s"
                + ("" if stats.spec is None else ", " + spec_summary(stats.spec)))
