"""Soak test: hours of mixed traffic in minutes. Drives a running server (--url) or starts
`python -m server` itself (--model), for --minutes, with a mix of workloads: streaming and
whole completions (several prompts, n > 1, logprobs, shared prefixes), structured outputs
(a JSON schema, a regex, choices: a finished output must satisfy its constraint), clients
that hang up mid-stream, and bad inputs that must get a 4xx (among them the reliability attacks: numbers
past int64, a lone surrogate, bytes that are not UTF-8, a non-JSON content type, a body past
the size cap). Every second it samples /metrics (vLLM names: KV-cache usage, running and
waiting requests), /health, and the RSS and GPU memory of the server's processes (the API
servers and the engine core, each by pid and together; GPU memory per process from
nvidia-smi, or the whole GPU's where nvidia-smi cannot see the server's pids).

Writes DIR/soak.json (requests served, outcomes, errors by kind, p99 latencies per window,
memory and block-pool usage over time; `rss_growth_mib` and `gpu_memory_growth_mib`: the
median over the last 10 s of traffic minus that over 10 s from the end of --warmup) and
DIR/soak.png (skipped without matplotlib). Exits 1 on any 5xx (a 503 included: the soak
stays far below the queue cap), transport error, 4xx on a valid request or lost request (a
stream that ended without [DONE], a bad input that was served, a malformed 200), a /health
that was not 200 or /metrics that did not answer, when the server does not drain to zero
requests and zero referenced KV blocks afterwards, or when the server it started exits other
than 0 on SIGTERM.

    python scripts/soak.py --minutes 10 --model checkpoints/gpt2-random \\
        --server-args "--device cuda" --concurrency 64 --out docs/benchmarks/h100/soak
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shlex
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from launch import launch_server, stop_server

GAUGES = {"kv_cache_usage": "vllm:kv_cache_usage_perc",
          "running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting"}
FATAL = ("5xx", "transport", "lost", "4xx_on_valid_input")  # outcomes that fail the soak


HUGE = 10**30  # past int64: msgpack cannot encode it, so it must not get past validation


def _is_answer(text: str) -> bool:
    value = json.loads(text)
    return set(value) == {"answer", "n"} and value["answer"] in ("yes", "no") \
        and value["n"] in range(10)


ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                 "n": {"type": "integer", "minimum": 0, "maximum": 9}},
                 "required": ["answer", "n"], "additionalProperties": False}
# (name, request fields, what a finished output satisfies)
STRUCTURED = [
    ("json_schema", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "answer", "schema": ANSWER_SCHEMA}}}, _is_answer),
    ("regex", {"guided_regex": r"\d{3}-[a-z]{2,8}"},
     lambda text: re.fullmatch(r"\d{3}-[a-z]{2,8}", text) is not None),
    ("choice", {"structured_outputs": {"choice": ["red", "green", "blue"]}},
     lambda text: text in ("red", "green", "blue")),
]


def bad_inputs(max_model_len: int, max_body_bytes: int
               ) -> list[tuple[str, dict[str, Any], float]]:
    """(name, httpx request kwargs, weight) of inputs the server must refuse with a 4xx."""
    post = {"method": "POST", "url": "/v1/completions"}
    as_json = {"content-type": "application/json"}
    # past the cap (413): 4 MiB of upload each time, so built once and sent rarely (its
    # weight makes it about one bad input in 200)
    over_cap = b'{"prompt": "' + b"x" * max_body_bytes + b'"}'
    return [(name, request, 1.0) for name, request in [
        ("malformed_json", {**post, "content": b'{"prompt": [1, 2'}),
        ("empty_body", {**post, "content": b""}),
        ("token_outside_vocab", {**post, "json": {"prompt": [1, 10**9], "max_tokens": 1}}),
        ("negative_max_tokens", {**post, "json": {"prompt": "x", "max_tokens": -1}}),
        ("unknown_model", {**post, "json": {"prompt": "x", "model": "no-such-model"}}),
        ("too_long", {**post, "json": {"prompt": [1] * (max_model_len + 1), "max_tokens": 1}}),
        ("n_zero", {**post, "json": {"prompt": "x", "n": 0}}),
        ("bad_regex", {**post, "json": {"prompt": "x", "guided_regex": "(ab"}}),
        ("wrong_type", {**post, "json": {"prompt": {"a": 1}, "temperature": "hot"}}),
        ("wrong_method", {"method": "GET", "url": "/v1/completions"}),
        ("top_k_past_int64", {**post, "json": {"prompt": "hi", "top_k": HUGE}}),
        ("seed_past_int64", {**post, "json": {"prompt": "hi", "seed": -HUGE}}),
        ("min_tokens_past_int64", {**post, "json": {"prompt": "hi", "min_tokens": HUGE}}),
        # the escaped form: json= cannot encode a lone surrogate, so the raw bytes go
        ("lone_surrogate_stop", {**post, "headers": as_json,
                                 "content": b'{"prompt": "hi", "stop": "\\ud800"}'}),
        ("not_utf8", {**post, "headers": as_json, "content": b'{"prompt": "hi\xff"}'}),
        ("text_plain", {**post, "headers": {"content-type": "text/plain"},
                        "content": b'{"prompt": "hi", "max_tokens": 1}'}),
    ]] + [("body_over_cap", {**post, "headers": as_json, "content": over_cap}, 0.08)]


class Soak:
    def __init__(self, args: argparse.Namespace, url: str, pid: int | None) -> None:
        self.args, self.url, self.pid = args, url, pid
        self.rng = random.Random(args.seed)
        self.prefixes = [self._tokens(64) for _ in range(4)]  # shared prefixes: cache hits
        self.bad_requests = bad_inputs(args.max_model_len, args.max_request_body_bytes)
        self.start = time.monotonic()
        self.deadline = self.start + args.minutes * 60
        self.records: list[dict[str, Any]] = []  # one per request
        self.samples: list[dict[str, Any]] = []  # one per sample interval

    def _tokens(self, count: int) -> list[int]:
        return [self.rng.randrange(50000) for _ in range(count)]

    def _prompt(self) -> list[int]:
        length = self.rng.randint(1, self.args.max_prompt_len)
        if self.rng.random() < 0.3:
            return self.rng.choice(self.prefixes)[:length] + self._tokens(4)
        return self._tokens(length)

    def _params(self) -> dict[str, Any]:
        params: dict[str, Any] = {"max_tokens": self.rng.randint(1, self.args.max_tokens),
                                  "temperature": self.rng.choice([0, 0, 0.8, 1.0])}
        if self.rng.random() < 0.5:
            params["ignore_eos"] = True
        if self.rng.random() < 0.2:
            params.update(top_p=0.9, seed=self.rng.randrange(1000))
        return params

    # ---------------------------------------------------------------- workloads
    async def worker(self, http: httpx.AsyncClient) -> None:
        kinds = ["stream", "complete", "disconnect", "bad", "structured"]
        while time.monotonic() < self.deadline:
            kind = self.rng.choices(kinds, weights=[30, 20, 25, 10, 15])[0]
            began = time.monotonic()
            record: dict[str, Any] = {"kind": kind, "ttft": None}
            try:
                record["outcome"] = await getattr(self, kind)(http, record, began)
            except httpx.TransportError as exc:
                record["outcome"] = f"transport:{type(exc).__name__}"
            except (ValueError, KeyError, TypeError) as exc:  # a 200 whose body is not right
                record["outcome"] = f"lost:malformed_response:{type(exc).__name__}"
                record["detail"] = repr(exc)[:300]
            record["t"] = time.monotonic() - self.start
            record["e2e"] = time.monotonic() - began
            self.records.append(record)

    async def stream(self, http: httpx.AsyncClient, record: dict[str, Any], began: float,
                     hang_up_after: int | None = None) -> str:
        body = {"prompt": self._prompt(), **self._params(), "stream": True}
        events = 0
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                record["detail"] = (await response.aread()).decode(errors="replace")[:300]
                return _status_outcome(response.status_code, valid=True)
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                events += 1
                if events == 1:
                    record["ttft"] = time.monotonic() - began
                if line == "data: [DONE]":
                    return "ok"
                if '"error"' in line[:16]:
                    record["detail"] = line[:300]
                    return "5xx:stream_error_event"
                if hang_up_after is not None and events >= hang_up_after:
                    return "disconnected"
        return "lost:stream_without_done"

    async def disconnect(self, http: httpx.AsyncClient, record: dict[str, Any],
                         began: float) -> str:
        return await self.stream(http, record, began, hang_up_after=self.rng.randint(1, 4))

    async def complete(self, http: httpx.AsyncClient, record: dict[str, Any],
                       began: float) -> str:
        prompts = [self._prompt() for _ in range(self.rng.choice([1, 1, 2, 3]))]
        body = {"prompt": prompts, **self._params(), "n": 1}
        if body["temperature"] > 0:  # n > 1 choices of a greedy request is a 400
            body["n"] = self.rng.choice([1, 2])
        if self.rng.random() < 0.3:
            body["logprobs"] = 2
        response = await http.post("/v1/completions", json=body)
        if response.status_code != 200:
            record["detail"] = response.text[:300]
            return _status_outcome(response.status_code, valid=True)
        choices = response.json()["choices"]
        if len(choices) != len(prompts) * body["n"]:
            return "lost:missing_choices"
        return "ok"

    async def structured(self, http: httpx.AsyncClient, record: dict[str, Any],
                         began: float) -> str:
        """A JSON schema, regex or choice constraint; a finished output must satisfy it."""
        kind, constraint, valid = self.rng.choice(STRUCTURED)
        record["kind"] = f"structured:{kind}"
        body = {"prompt": self._prompt(), **self._params(), **constraint}
        body.update(max_tokens=256, ignore_eos=False)
        response = await http.post("/v1/completions", json=body)
        if response.status_code != 200:
            record["detail"] = response.text[:300]
            return _status_outcome(response.status_code, valid=True)
        [choice] = response.json()["choices"]
        if choice["finish_reason"] == "stop" and not valid(choice["text"]):
            record["detail"] = choice["text"][:300]
            return "lost:invalid_structured_output"
        return "ok"

    async def bad(self, http: httpx.AsyncClient, record: dict[str, Any], began: float) -> str:
        name, request, _ = self.rng.choices(self.bad_requests,
                                            weights=[w for *_, w in self.bad_requests])[0]
        record["kind"] = f"bad:{name}"
        response = await http.request(**request)
        if 400 <= response.status_code < 500:
            return "rejected"
        record["detail"] = response.text[:300]
        return _status_outcome(response.status_code, valid=False)

    # ----------------------------------------------------------------- sampling
    async def sampler(self, http: httpx.AsyncClient) -> None:
        while time.monotonic() < self.deadline:
            await self.sample(http)
            await asyncio.sleep(self.args.sample_interval)

    async def sample(self, http: httpx.AsyncClient) -> dict[str, Any]:
        """Gauges (None where /metrics did not answer), /health's status (or the transport
        error's name), and memory: RSS by pid and together, GPU memory."""
        sample: dict[str, Any] = {"t": time.monotonic() - self.start}
        try:
            text = (await http.get("/metrics")).text
            sample.update({key: metric_value(text, name) for key, name in GAUGES.items()})
        except httpx.TransportError as exc:
            sample.update({key: None for key in GAUGES}, metrics_error=type(exc).__name__)
        try:
            sample["health"] = (await http.get("/health")).status_code
        except httpx.TransportError as exc:
            sample["health"] = type(exc).__name__
        pids = await asyncio.to_thread(process_tree, self.pid)
        by_pid = {pid: rss_mib([pid]) for pid in pids}
        by_pid = {pid: mib for pid, mib in by_pid.items() if mib is not None}
        gpu, gpu_source = await asyncio.to_thread(gpu_memory, pids)
        sample.update(rss_mib=sum(by_pid.values()) if by_pid else None,
                      rss_mib_by_pid={str(pid): round(mib, 1) for pid, mib in by_pid.items()},
                      gpu_mib=gpu, gpu_source=gpu_source)
        self.samples.append(sample)
        return sample

    async def drained(self, http: httpx.AsyncClient, timeout: float = 60) -> bool:
        """The server holds no request and no referenced KV block once the traffic stops."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            last = await self.sample(http)
            if last["running"] == last["waiting"] == last["kv_cache_usage"] == 0:
                return True
            await asyncio.sleep(0.5)
        return False

    async def run(self) -> dict[str, Any]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=self.url, timeout=self.args.request_timeout,
                                     limits=limits) as http:
            await asyncio.gather(self.sampler(http),
                                 *(self.worker(http) for _ in range(self.args.concurrency)))
            traffic_end = time.monotonic() - self.start
            drained = await self.drained(http)
        return summarize(self.records, self.samples, drained, self.args.window,
                         warmup=self.args.warmup, traffic_end=traffic_end)


def _status_outcome(status: int, valid: bool) -> str:
    if status >= 500:  # a 503 too: the soak's few hundred sequences are far below the cap
        return f"5xx:{status}"
    if status >= 400:
        return f"4xx_on_valid_input:{status}"
    return "ok" if valid else "lost:bad_input_served"


def metric_value(text: str, name: str) -> float:
    """The first sample of `name` in Prometheus text (0 when absent)."""
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})?\s+(\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def process_tree(pid: int | None) -> list[int]:
    """`pid` and its descendants: the API server and its engine-core process."""
    if pid is None:
        return []
    parent_of = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # after the ")" that ends the command name: state, then the parent's pid
            parent_of[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
    tree = [pid]
    for member in tree:  # grows while walked: breadth first
        tree.extend(child for child, parent in parent_of.items() if parent == member)
    return tree


def rss_mib(pids: list[int]) -> float | None:
    """The resident memory of these processes together (None when none is readable here)."""
    total = None
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        total = (total or 0.0) + int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024
    return total


def _nvidia_smi(query: str) -> list[list[str]]:
    try:
        out = subprocess.run(["nvidia-smi", query, "--format=csv,noheader,nounits"],
                             check=False, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [[field.strip() for field in line.split(",")] for line in out.splitlines()
            if line.strip()]


def gpu_mib(pids: list[int]) -> float | None:
    """GPU memory these processes hold, from nvidia-smi (None without a GPU, or where it
    lists none of them: in a container it may list the host's pids)."""
    used = []
    for row in _nvidia_smi("--query-compute-apps=pid,used_memory"):
        try:
            if int(row[0]) in pids:
                used.append(float(row[1]))
        except (IndexError, ValueError):  # "[N/A]" and the like
            continue
    return sum(used) if used else None


def gpu_memory(pids: list[int]) -> tuple[float | None, str | None]:
    """(MiB, source): the server's processes' GPU memory ("processes"), else, with a server
    to measure, every GPU's used memory together ("device": on a dedicated node, the
    server's plus the driver's), else (None, None)."""
    mib = gpu_mib(pids)
    if mib is not None:
        return mib, "processes"
    if not pids:
        return None, None
    used = []
    for row in _nvidia_smi("--query-gpu=memory.used"):
        try:
            used.append(float(row[0]))
        except (IndexError, ValueError):
            continue
    return (sum(used), "device") if used else (None, None)


def growth(samples: list[dict[str, Any]], key: str, warmup: float, traffic_end: float,
           span: float = 10.0) -> dict[str, Any] | None:
    """`key`'s median over the last `span` s of traffic minus its median over `span` s from
    `warmup` on (the warmed-up point): what a leak adds. None without two such samples."""
    def median_over(start: float, end: float) -> float | None:
        values = [s[key] for s in samples if start <= s["t"] < end and s.get(key) is not None]
        return float(np.median(values)) if values else None

    warm = median_over(warmup, warmup + span)
    end = median_over(max(traffic_end - span, warmup), traffic_end + 1e-9)
    if warm is None or end is None:
        return None
    return {"warmed_up_s": warmup, "at_warmup": warm, "at_end": end, "growth": end - warm}


def summarize(records: list[dict[str, Any]], samples: list[dict[str, Any]], drained: bool,
              window: float, warmup: float = 0.0, traffic_end: float | None = None
              ) -> dict[str, Any]:
    outcomes = Counter(r["outcome"] for r in records)
    errors = {k: v for k, v in outcomes.items() if k not in ("ok", "rejected", "disconnected")}
    traffic_end = traffic_end if traffic_end is not None else \
        max((s["t"] for s in samples), default=0.0)
    unhealthy = Counter(str(s["health"]) for s in samples if s.get("health", 200) != 200)
    metrics_errors = Counter(s["metrics_error"] for s in samples if s.get("metrics_error"))
    windows = []
    for start in np.arange(0, max((r["t"] for r in records), default=0), window):
        inside = [r for r in records if start <= r["t"] < start + window]
        ok = [r for r in inside if r["outcome"] == "ok"]
        ttfts = [r["ttft"] for r in ok if r["ttft"] is not None]
        windows.append({"t": float(start), "requests": len(inside), "ok": len(ok),
                        "errors": sum(r["outcome"] in errors for r in inside),
                        "p99_e2e_s": p99([r["e2e"] for r in ok]), "p99_ttft_s": p99(ttfts)})
    rss = [s["rss_mib"] for s in samples if s["rss_mib"] is not None]
    gpu = [s["gpu_mib"] for s in samples if s["gpu_mib"] is not None]
    rss_growth = growth(samples, "rss_mib", warmup, traffic_end)
    gpu_growth = growth(samples, "gpu_mib", warmup, traffic_end)
    by_pid: dict[str, Any] = {}  # which process grew: API servers or the engine core
    for pid in {pid for s in samples for pid in s.get("rss_mib_by_pid", {})}:
        rows = [{"t": s["t"], "mib": s["rss_mib_by_pid"].get(pid)} for s in samples]
        grown = growth(rows, "mib", warmup, traffic_end)
        by_pid[pid] = None if grown is None else round(grown["growth"], 1)
    return {
        "requests": len(records), "served": outcomes["ok"], "outcomes": dict(outcomes),
        "errors_by_kind": errors,
        "error_examples": {r["outcome"]: r.get("detail") for r in records
                           if r["outcome"] in errors},
        "kinds": dict(Counter(r["kind"] for r in records)),
        "fatal": sum(v for k, v in errors.items() if k.startswith(FATAL))
        + sum(unhealthy.values()) + sum(metrics_errors.values()),
        "unhealthy_samples": dict(unhealthy), "metrics_errors": dict(metrics_errors),
        "drained": drained, "windows": windows,
        "rss_growth_mib": None if rss_growth is None else rss_growth["growth"],
        "gpu_memory_growth_mib": None if gpu_growth is None else gpu_growth["growth"],
        "rss_mib": {"first": rss[0], "last": rss[-1], "max": max(rss), "growth": rss_growth,
                    "growth_by_pid": by_pid} if rss else None,
        "gpu_mib": {"first": gpu[0], "last": gpu[-1], "max": max(gpu), "growth": gpu_growth,
                    "source": sorted({s["gpu_source"] for s in samples
                                      if s.get("gpu_source")})} if gpu else None,
        "kv_cache_usage_max": max((s["kv_cache_usage"] for s in samples
                                   if s["kv_cache_usage"] is not None), default=0.0),
        "samples": samples,
    }


def process_roles(log_path: Path, root: int) -> dict[str, str]:
    """pid -> "engine-core", "api-server" or "main", from the server's startup log lines."""
    roles = {str(root): "main"}
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    for pid in re.findall(r"engine core: pid (\d+)", text):
        roles[pid] = "engine-core"
    for pids in re.findall(r"API servers \(pids ([\d ]+)\)", text):
        roles.update((pid, "api-server") for pid in pids.split())
    return roles


def p99(values: list[float]) -> float | None:
    return float(np.percentile(values, 99)) if values else None


def plot(summary: dict[str, Any], path: Path) -> bool:
    """The PNG; False (and no file) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    windows, samples = summary["windows"], summary["samples"]

    def series(rows: list[dict[str, Any]], key: str) -> list[float]:
        return [np.nan if row[key] is None else row[key] for row in rows]

    fig, axes = plt.subplots(4, 1, figsize=(10, 12), sharex=True)
    wt = [w["t"] for w in windows]
    axes[0].plot(wt, [w["ok"] for w in windows], label="served")
    axes[0].plot(wt, [w["requests"] for w in windows], label="all requests")
    axes[0].plot(wt, [w["errors"] for w in windows], label="errors")
    axes[0].set_ylabel("requests per window")
    axes[1].plot(wt, series(windows, "p99_e2e_s"), label="p99 end to end")
    axes[1].plot(wt, series(windows, "p99_ttft_s"), label="p99 TTFT (streams)")
    axes[1].set_ylabel("seconds")
    st = [s["t"] for s in samples]
    axes[2].plot(st, series(samples, "rss_mib"), label="server RSS (API + engine core)")
    axes[2].plot(st, series(samples, "gpu_mib"), label="server GPU memory")
    axes[2].set_ylabel("MiB")
    axes[3].plot(st, series(samples, "kv_cache_usage"), label="KV-cache usage (0-1)")
    twin = axes[3].twinx()
    twin.plot(st, series(samples, "running"), "g:", label="running")
    twin.plot(st, series(samples, "waiting"), "r:", label="waiting")
    twin.set_ylabel("requests")
    twin.legend(loc="upper right")
    axes[3].set_xlabel("seconds since start")
    for ax in axes:
        ax.legend(loc="upper left")
        ax.grid(alpha=0.3)
    fig.suptitle(f"soak: {summary['served']} served, {summary['fatal']} fatal errors, "
                 f"drained={summary['drained']}")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, required=True)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running server")
    target.add_argument("--model", help="start `python -m server --model MODEL` here")
    parser.add_argument("--pid", type=int, help="with --url: the server's pid, for its RSS "
                        "and GPU memory")
    parser.add_argument("--server-args", default="", help="more flags for the server started")
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--concurrency", type=int, default=32, help="clients at once")
    parser.add_argument("--max-prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--request-timeout", type=float, default=300)
    parser.add_argument("--sample-interval", type=float, default=1.0)
    parser.add_argument("--window", type=float, help="seconds per latency window "
                        "(default: a twentieth of the run, at most 30)")
    parser.add_argument("--warmup", type=float, help="seconds after which the server counts "
                        "as warmed up: memory growth is measured from there to the end "
                        "(default: a quarter of the run, at most 60)")
    parser.add_argument("--max-request-body-bytes", type=int, default=4 << 20,
                        help="the server's body cap: the over-cap bad input is a few bytes "
                        "larger (default: the server's, 4 MiB)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("soak-out"))
    args = parser.parse_args()
    args.window = args.window or min(30.0, max(1.0, args.minutes * 60 / 20))
    args.warmup = args.warmup if args.warmup is not None else min(60.0, args.minutes * 60 / 4)
    args.out.mkdir(parents=True, exist_ok=True)
    proc, url = (launch_server(["--model", args.model, *shlex.split(args.server_args)],
                               args.out / "server.log", args.startup_timeout)
                 if args.model else (None, args.url))
    try:
        summary = asyncio.run(Soak(args, url, proc.pid if proc else args.pid).run())
    finally:
        shutdown = stop_server(proc) if proc else None
    summary["shutdown"] = shutdown
    if proc and summary["rss_mib"]:  # name the processes: which one grew
        roles = process_roles(args.out / "server.log", proc.pid)
        summary["rss_mib"]["growth_by_pid"] = {
            f"{pid} {roles.get(pid, 'other')}": grown
            for pid, grown in summary["rss_mib"]["growth_by_pid"].items()}
    (args.out / "soak.json").write_text(json.dumps(summary, indent=1))
    if not plot(summary, args.out / "soak.png"):
        print("matplotlib is not installed: no soak.png", file=sys.stderr)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("samples", "windows")},
                     indent=1))
    exited_badly = bool(shutdown and shutdown["exit_code"] != 0)  # e.g. 1: the core died
    sys.exit(1 if summary["fatal"] or not summary["drained"] or exited_badly else 0)


if __name__ == "__main__":
    main()
