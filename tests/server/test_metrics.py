"""ServerMetrics batches what it is fed per token and per request and flushes it into
prometheus_client: what /metrics exports must equal one `inc`/`observe` per value, lose no
token and count none twice, and be up to date after every batch of engine steps."""
from __future__ import annotations

import asyncio
import math
import random
import time
from itertools import pairwise

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.core.messages import EngineStats, SequenceOutput, StepOutput
from engine.core.request import SamplingParams
from engine.output.tokenizer import Tokenizer
from fakes import ScriptedCore
from server.engine_client import EngineClient
from server.metrics import ITL_BUCKETS, BatchedHistogram, ServerMetrics

STATS = EngineStats(1, 0, 0.0, 0, 0, 0, 1, 1)
ITL = "vllm:inter_token_latency_seconds"


def samples(text: bytes | str) -> dict[tuple[str, tuple], float]:
    """Every sample of an exposition, by name and labels (the _created ones left out)."""
    if isinstance(text, bytes):
        text = text.decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if not s.name.endswith("_created")}


def histogram_samples(text: bytes | str, name: str) -> dict[str, float]:
    """A histogram's buckets (by le), _count and _sum."""
    found = {}
    for (sample, labels), value in samples(text).items():
        if sample == name + "_bucket":
            found[dict(labels)["le"]] = value
        elif sample in (name + "_count", name + "_sum"):
            found[sample[len(name):]] = value
    return found


def reference_histogram(values: list[float], buckets: list[float]) -> dict[str, float]:
    """What prometheus_client exports after one observe per value."""
    registry = CollectorRegistry()
    histogram = Histogram("h", "h", ["model_name"], buckets=buckets,
                          registry=registry).labels("m")
    for value in values:
        histogram.observe(value)
    return histogram_samples(generate_latest(registry), "h")


def assert_same_histogram(got: dict[str, float], want: dict[str, float]) -> None:
    assert got.keys() == want.keys()
    assert got.pop("_sum") == pytest.approx(want.pop("_sum"), rel=1e-12, abs=1e-12)
    assert got == want


def test_a_batched_histogram_exports_what_one_observe_per_value_does():
    """Values on the bounds, between them, below the first, past the last, negative, several
    flushes, a flush with nothing pending."""
    rng = random.Random(7)
    batches = [list(ITL_BUCKETS), [-1.0, 0.0, 1e9, ITL_BUCKETS[-1] * 2], [],
               [rng.uniform(0.0, 100.0) for _ in range(500)],
               [rng.choice(ITL_BUCKETS) for _ in range(300)]]
    registry = CollectorRegistry()
    batched = BatchedHistogram(Histogram("h", "h", ["model_name"], buckets=ITL_BUCKETS,
                                         registry=registry).labels("m"))
    observed: list[float] = []
    for batch in batches:
        batched.observe_all(batch[:len(batch) // 2])
        for value in batch[len(batch) // 2:]:
            batched.observe(value)
        batched.flush()
        observed += batch
        assert_same_histogram(histogram_samples(generate_latest(registry), "h"),
                              reference_histogram(observed, ITL_BUCKETS))
    assert batched.samples == []


# gaps between a sequence's tokens, in seconds: bucket bounds among them
GAPS = [0.01, 0.05, 0.3, 0.003, 1.0, 2.5, 0.75, 0.12, 90.0]


def script(seq_ids: list[str], rng: random.Random
           ) -> tuple[list[StepOutput], dict[str, list[float]]]:
    """Steps in which every sequence takes 1 to 30 tokens, some steps several tokens at once
    (as a finishing sequence's deferred tokens come), each token at its own time; and each
    sequence's token times."""
    base = time.monotonic()
    plans = {}
    for seq_id in seq_ids:
        times, now = [], base + rng.random()
        for _ in range(rng.randint(1, 30)):
            now += rng.choice(GAPS)
            times.append(now)
        plans[seq_id] = times
    steps, sent = [], dict.fromkeys(seq_ids, 0)
    while any(sent[s] < len(plans[s]) for s in seq_ids):
        outputs = []
        for seq_id in seq_ids:
            times, start = plans[seq_id], sent[seq_id]
            if start == len(times):
                continue
            end = min(len(times), start + rng.choice([1, 1, 1, 2, 3]))
            last = end == len(times)
            outputs.append(SequenceOutput(
                seq_id, [(start + i) % 50000 + 10 for i in range(end - start)],
                times[start:end], None, "length" if last else None, None,
                times[-1] if last else None, base, 0))
            sent[seq_id] = end
        steps.append(StepOutput(outputs, STATS))
    return steps, plans


def gaps(times: list[float]) -> list[float]:
    return [after - before for before, after in pairwise(times)]


def test_every_streamed_token_is_counted_once_and_each_latency_observed_once():
    """Requests of one and two choices stream through EngineClient in batches of one to
    four steps. After every batch the registry (read without render's own flush) holds every
    token delivered so far and the latencies of every finished sequence; at the end the
    inter-token latency histogram is exactly one observe per consecutive token pair."""
    async def run() -> None:
        rng = random.Random(11)
        core = ScriptedCore()
        metrics = ServerMetrics("m", core.max_model_len)
        engine = EngineClient(core, Tokenizer(), max_queued_requests=1000,
                              observe_output=metrics.observe_output,
                              observe_stats=metrics.observe_stats,
                              observe_request=metrics.observe_request,
                              flush_observations=metrics.flush)
        engine.start()
        prompts = [[1, 2, 3], [4, 5], [6] * 7, [8]]
        generations = [engine.generate(f"r{i}", [prompt], SamplingParams(
            n=1 + i % 2, max_tokens=30, ignore_eos=True)) for i, prompt in enumerate(prompts)]
        streamed: list[int] = []  # every delta token id the consumers received

        async def consume(generation) -> None:
            async for ready in generation:
                for _, output in ready:
                    for choice in output.outputs:
                        streamed.extend(choice.delta_token_ids)

        consumers = [asyncio.create_task(consume(g)) for g in generations]
        steps, plans = script(core.seq_ids, rng)
        choices: dict[str, list[str]] = {}  # request id -> its sequences
        for seq_id in core.seq_ids:
            choices.setdefault(seq_id.rsplit("#", 1)[0], []).append(seq_id)
        running = {request: set(seq_ids) for request, seq_ids in choices.items()}
        delivered, finished_gaps, index = 0, [], 0
        while index < len(steps):
            batch = steps[index:index + rng.randint(1, 4)]
            index += len(batch)
            for step in batch:
                core.deliver(step)
            await asyncio.sleep(0)  # the batch is handled
            for output in (o for step in batch for o in step.outputs):
                delivered += len(output.new_token_ids)
                request = output.seq_id.rsplit("#", 1)[0]
                if output.finish_reason is not None:
                    running[request].discard(output.seq_id)
                    if not running[request]:  # latencies are observed as a request ends
                        finished_gaps += [gap for seq_id in choices[request]
                                          for gap in gaps(plans[seq_id])]
            exported = samples(generate_latest(metrics.registry))
            assert exported["vllm:generation_tokens_total", (("model_name", "m"),)] \
                == delivered
            itl = histogram_samples(generate_latest(metrics.registry), ITL)
            assert itl["_count"] == len(finished_gaps)
            assert itl["_sum"] == pytest.approx(math.fsum(finished_gaps), rel=1e-12)
        await asyncio.gather(*consumers)
        await engine.stop(timeout=1.0)

        text = metrics.render()
        every_gap = [gap for times in plans.values() for gap in gaps(times)]
        assert_same_histogram(histogram_samples(text, ITL),
                              reference_histogram(every_gap, ITL_BUCKETS))
        assert len(every_gap) == len(streamed) - len(plans)  # a token pair per latency
        exported = samples(text)
        model = (("model_name", "m"),)
        assert exported["vllm:generation_tokens_total", model] == len(streamed) == delivered
        assert exported["vllm:prompt_tokens_total", model] == sum(map(len, prompts))
        assert exported["vllm:request_success_total",
                        (("finished_reason", "length"), ("model_name", "m"))] == len(plans)
        lengths = histogram_samples(text, "vllm:request_generation_tokens")
        assert (lengths["_count"], lengths["_sum"]) == (len(plans), len(streamed))
        for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                     "request_decode_time_seconds"):
            assert histogram_samples(text, f"vllm:{name}")["_count"] == len(plans), name
        assert histogram_samples(text, "vllm:request_params_n")["_count"] == len(prompts)

    asyncio.run(run())
