"""A random workload for LLMEngine over the fake runners (fakes.py), with its checks."""
from __future__ import annotations

import random

from engine.core.request import SamplingParams
from engine.llm import LLMEngine
from engine.output.tokenizer import Tokenizer
from fakes import reference_output


def run_random_workload(engine: LLMEngine, rng: random.Random, output_kind: str = "stream",
                        on_add=lambda seq_id, reference: None) -> None:
    """Requests arrive over 30 steps (on_add sees each one's sequence id and reference
    output), some are aborted, the engine runs dry; every request ends exactly once with a
    prefix of its reference, cut by its stop string or max_tokens."""
    text_of = Tokenizer().decode
    expected, aborted, finals = {}, set(), {}
    for step in range(600):
        if step < 30 and rng.random() < 0.4:
            prompt = [rng.randrange(90) for _ in range(rng.randint(1, 10))]
            stop = (rng.choice("ABCDEFGH"),) if rng.random() < 0.5 else ()
            params = SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True, stop=stop,
                                    output_kind=output_kind)
            expected[f"r{step}"] = (reference_output(prompt, params.max_tokens), stop)
            on_add(f"r{step}#0", expected[f"r{step}"][0])
            engine.add_request(f"r{step}", prompt, params)
        if engine.has_unfinished_requests() and rng.random() < 0.05:
            rid = rng.choice(sorted(set(expected) - aborted - set(finals)))  # the live ones
            engine.abort(rid)
            aborted.add(rid)
        for out in engine.step():
            assert out.request_id not in finals, "output after the request finished"
            if out.finished:
                finals[out.request_id] = out
        engine.block_manager.check_invariants()
        if step >= 30 and not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests()
    assert set(finals) | aborted == set(expected)
    for rid, out in finals.items():
        tokens, stop = expected[rid]
        assert out.token_ids == tokens[:len(out.token_ids)]
        full = text_of(tokens)
        if stop and stop[0] in full:
            assert out.finish_reason == "stop" and out.text == full[:full.index(stop[0])]
        else:
            assert out.finish_reason == "length" and out.token_ids == tokens
