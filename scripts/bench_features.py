"""Issue 27's speed table: structured outputs, prompt logprobs and beam search, each against
the same engine without the feature, in one process (one engine, so one job's ratios).

    python scripts/bench_features.py --model gpt2 --out docs/benchmarks/features

Sections (--sections, default all):
  structured       64 streams under a JSON schema against 64 free streams of the same output
                   lengths; a batch of 64 where 8 are constrained against one where none is
                   (medians of 3 runs each, taking turns)
  compile          the schema's first compile and a cache hit
  prompt-logprobs  TTFT of a 512-token prompt with prompt_logprobs=1 against without
  beam             beam search, 4 beams x 64 tokens, against n = 4 sampling of 64 tokens (and,
                   for scale, n = 4 greedy decoding with the 8 logprobs a beam's step asks for)
Random token prompts (fresh per run: the prefix cache never helps either side). Each pair's
ratio is kept beside the host probe taken just before it (bench_utils.host_probe_us): the
ratios are host-bound, and the node's host changes speed from one pair to the next.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch
from bench_utils import BENCH_DIR, checkpoint_for, device_info, host_probe_us, write_result

from engine import LLM, SamplingParams, StructuredOutputsParams

ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
          "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "n"], "additionalProperties": False}
# long enough outputs (16 answers) that decode, not admission, sets the rate
SCHEMA = {"type": "object", "properties": {"answers": {
    "type": "array", "items": ANSWER, "minItems": 16, "maxItems": 16}},
    "required": ["answers"], "additionalProperties": False}
LONG_REGEX = "[a-z ,.]{2000}"  # never complete within 128 tokens: every row runs to length


class Prompts:
    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def take(self, n: int, length: int) -> list[list[int]]:
        return [[self.rng.randrange(50256) for _ in range(length)] for _ in range(n)]


def timed(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, result


def generate(llm: LLM, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def bench_structured(llm: LLM, prompts: Prompts, repeats: int = 3) -> dict:
    spec = StructuredOutputsParams(json=SCHEMA)
    # as many streams as timed: every grammar child has started and compiled the schema
    generate(llm, prompts.take(64, 64), SamplingParams(max_tokens=512, structured_outputs=spec))
    ratios, rates, free_rates, tokens, valid, probes = [], [], [], 0, 0, []
    for _ in range(repeats):  # alternated, so drift hits both alike
        probes.append(host_probe_us())
        seconds, outs = timed(lambda: generate(llm, prompts.take(64, 64), SamplingParams(
            max_tokens=512, temperature=1.0, structured_outputs=spec)))
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        valid += sum(o.outputs[0].finish_reason == "stop" and _valid(o.outputs[0].text)
                     for o in outs)
        batch = prompts.take(64, 64)
        free_seconds, _ = timed(lambda: generate(llm, batch, [
            SamplingParams(max_tokens=n, temperature=1.0, ignore_eos=True) for n in lengths]))
        tokens += sum(lengths)
        rates.append(sum(lengths) / seconds)
        free_rates.append(sum(lengths) / free_seconds)
        ratios.append(rates[-1] / free_rates[-1])
    mixed = _one_in_eight(llm, prompts, repeats)
    return {"schema_streams": 64, "repeats": repeats, "output_tokens": tokens,
            "valid_outputs": valid, "constrained_tok_s": statistics.median(rates),
            "free_tok_s": statistics.median(free_rates),
            "constrained_over_free": statistics.median(ratios), "ratios": ratios,
            "host_probe_us": probes, **mixed}


def _valid(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return len(value["answers"]) == 16 and all(a["answer"] in ("yes", "no") for a in
                                                 value["answers"])


def _one_in_eight(llm: LLM, prompts: Prompts, repeats: int = 3) -> dict:
    free = SamplingParams(max_tokens=128, temperature=1.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=128, temperature=1.0, ignore_eos=True,
                                 structured_outputs=StructuredOutputsParams(regex=LONG_REGEX))
    generate(llm, prompts.take(8, 64), constrained)  # the regex compiled before it is timed
    none, some, probes = [], [], []
    for _ in range(repeats):  # alternated, so drift hits both alike
        probes.append(host_probe_us())
        none.append(timed(lambda: generate(llm, prompts.take(64, 64), free))[0])
        some.append(timed(lambda: generate(llm, prompts.take(64, 64),
                                           [constrained] * 8 + [free] * 56))[0])
    return {"batch64_none_s": statistics.median(none), "batch64_8_constrained_s":
            statistics.median(some),
            "one_in_eight_over_none": statistics.median(some) / statistics.median(none),
            "one_in_eight_ratios": [b / a for a, b in zip(none, some)],
            "one_in_eight_host_probe_us": probes}


def bench_compile() -> dict:
    from engine.structured.grammar import compiler
    from engine.structured.manager import StructuredOutputs

    setup, _ = timed(compiler)
    grammars = StructuredOutputs(max_rows=1)
    spec = StructuredOutputsParams(json=dict(SCHEMA, title=f"fresh-{time.time()}"))

    def compile_one(seq_id: str) -> None:
        grammars.submit(seq_id, spec)
        while not grammars.take_compiled(timeout=1.0):
            pass

    first, _ = timed(lambda: compile_one("a"))
    hits = [timed(lambda: compile_one(f"b{i}"))[0] for i in range(20)]
    return {"compiler_setup_ms": setup * 1e3, "first_compile_ms": first * 1e3,
            "cache_hit_ms": statistics.median(hits) * 1e3}


def bench_prompt_logprobs(llm: LLM, prompts: Prompts, repeats: int = 10) -> dict:
    plain = SamplingParams(max_tokens=1)
    asked = SamplingParams(max_tokens=1, prompt_logprobs=1)
    generate(llm, prompts.take(1, 512), asked)
    without, with_ = [], []
    for _ in range(repeats):
        without.append(timed(lambda: generate(llm, prompts.take(1, 512), plain))[0])
        with_.append(timed(lambda: generate(llm, prompts.take(1, 512), asked))[0])
    return {"ttft_without_ms": statistics.median(without) * 1e3,
            "ttft_with_ms": statistics.median(with_) * 1e3,
            "with_over_without": statistics.median(with_) / statistics.median(without)}


def bench_beam(llm: LLM, prompts: Prompts, repeats: int = 3) -> dict:
    from engine.beam_search import BeamSearchParams

    beam = BeamSearchParams(beam_width=4, max_tokens=64, ignore_eos=True)
    sampled = SamplingParams(n=4, max_tokens=64, temperature=1.0, ignore_eos=True)
    with_logprobs = SamplingParams(n=4, max_tokens=64, temperature=0.0, logprobs=8,
                                   ignore_eos=True)
    llm.beam_search(prompts.take(1, 64), beam)
    beams, samples, logprobs, probes = [], [], [], []
    for _ in range(repeats):
        [prompt] = prompts.take(1, 64)
        probes.append(host_probe_us())
        beams.append(timed(lambda: llm.beam_search([prompt], beam))[0])
        samples.append(timed(lambda: generate(llm, [prompts.take(1, 64)[0]], sampled))[0])
        logprobs.append(timed(lambda: generate(llm, [prompts.take(1, 64)[0]], with_logprobs))[0])
    return {"beam_4x64_s": statistics.median(beams), "n4_sampling_64_s":
            statistics.median(samples),
            "n4_greedy_logprobs8_64_s": statistics.median(logprobs),
            "beam_over_sampling": statistics.median(beams) / statistics.median(samples),
            "ratios": [b / s for b, s in zip(beams, samples)], "host_probe_us": probes}


SECTIONS = ("structured", "compile", "prompt-logprobs", "beam")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "features")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each side of the structured and beam rows (medians)")
    args = parser.parse_args()
    sections = args.sections.split(",")
    llm = LLM(checkpoint_for(args.model), device=args.device)
    prompts = Prompts()
    result = {"model": args.model, **device_info()}
    runs = {"structured": lambda: bench_structured(llm, prompts, args.repeats),
            "compile": bench_compile,
            "prompt-logprobs": lambda: bench_prompt_logprobs(llm, prompts),
            "beam": lambda: bench_beam(llm, prompts, args.repeats)}
    for name in sections:
        result[name] = runs[name]()
        print(name, json.dumps(result[name], indent=1), flush=True)
    write_result("features", result, args.out)


if __name__ == "__main__":
    main()
