"""Latency metrics from each request's event times, and vLLM's labelled report.

  TTFT  time to first token: first streamed chunk - request sent
  ITL   inter-token latency: gap between consecutive streamed chunks
  TPOT  time per output token after the first: (E2EL - TTFT) / (output tokens - 1)
  E2EL  end-to-end latency: last byte - request sent
  goodput  completed requests per second that met every SLO
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    """What one request saw, as `time.monotonic()` instants (comparable across processes)."""
    start: float
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # chunks that carried output
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def e2el(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def distribution_ms(values: list[float], name: str, percentiles: list[float]) -> dict:
    """mean/median/std and the asked percentiles (linear interpolation, as numpy and vLLM)."""
    ms = np.array(values or [0.0]) * 1000.0
    stats = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
             f"std_{name}_ms": float(ms.std())}
    stats |= {f"p{p:g}_{name}_ms": float(np.percentile(ms, p)) for p in percentiles}
    return stats


def meets_slos(result: RequestResult, slos_ms: dict[str, float]) -> bool:
    measured = {"ttft": result.ttft, "tpot": result.tpot or 0.0, "e2el": result.e2el}
    return all(measured[name] * 1000.0 <= limit for name, limit in slos_ms.items())


def peak_concurrency(results: list[RequestResult]) -> int:
    """Most requests in flight at one instant (an end at the same instant as a start frees
    its slot first)."""
    events = sorted([(r.start, 1) for r in results] + [(r.end, -1) for r in results])
    in_flight = peak = 0
    for _, step in events:
        in_flight += step
        peak = max(peak, in_flight)
    return peak


def summarize(results: list[RequestResult], start: float, percentiles: list[float],
              slos_ms: dict[str, float] | None = None) -> dict:
    """vLLM's result fields; the run lasts from `start` to the last request's end."""
    done = [r for r in results if r.ok]
    duration = max((r.end for r in results), default=start) - start
    output_tokens = sum(r.output_tokens for r in done)
    input_tokens = sum(r.prompt_tokens for r in done)
    summary = {
        "duration": duration, "completed": len(done), "failed": len(results) - len(done),
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "max_concurrent_requests": peak_concurrency(done),
    }
    if slos_ms:
        summary["request_goodput"] = sum(meets_slos(r, slos_ms) for r in done) / duration
    summary |= distribution_ms([r.ttft for r in done], "ttft", percentiles)
    summary |= distribution_ms([r.tpot for r in done if r.tpot is not None], "tpot",
                               percentiles)
    summary |= distribution_ms([gap for r in done for gap in r.itl], "itl", percentiles)
    summary |= distribution_ms([r.e2el for r in done], "e2el", percentiles)
    summary["errors"] = sorted({r.error for r in results if r.error})[:10]
    return summary


SECTIONS = (("ttft", "TTFT", "Time to First Token"),
            ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
            ("itl", "ITL", "Inter-token Latency"),
            ("e2el", "E2EL", "End-to-end Latency"))


def report(summary: dict, percentiles: list[float], client_cpu: list[float]) -> str:
    """The summary as `vllm bench serve` prints it ("Mean TTFT (ms):" ...), plus the load
    generator's own CPU use per worker process."""
    lines = ["{:=^50}".format(" Serving Benchmark Result ")]

    def row(label: str, value: object) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<40} {text:<10}")

    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    row("Benchmark duration (s):", summary["duration"])
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", summary["request_throughput"])
    if "request_goodput" in summary:
        row("Request goodput (req/s):", summary["request_goodput"])
    row("Output token throughput (tok/s):", summary["output_throughput"])
    row("Peak concurrent requests:", summary["max_concurrent_requests"])
    row("Total Token throughput (tok/s):", summary["total_token_throughput"])
    for key, short, title in SECTIONS:
        lines.append("{:-^50}".format(title))
        row(f"Mean {short} (ms):", summary[f"mean_{key}_ms"])
        row(f"Median {short} (ms):", summary[f"median_{key}_ms"])
        for p in percentiles:
            row(f"P{p:g} {short} (ms):", summary[f"p{p:g}_{key}_ms"])
    lines.append("{:-^50}".format("Load Generator"))
    row("Client worker processes:", len(client_cpu))
    row("Client CPU per worker (%):", " ".join(f"{cpu:.1f}" for cpu in client_cpu))
    lines += [f"error: {error}" for error in summary["errors"]]
    lines.append("=" * 50)
    return "\n".join(lines)
