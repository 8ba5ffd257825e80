"""The load generator (server/bench, `gpt2-bench`, scripts/bench_serving.py): metric
arithmetic on a synthetic event trace with known answers, workloads, argument errors, and
sweeps with several client processes against a real server."""
from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
import tomllib
from argparse import Namespace
from importlib import import_module

import pytest
from aiohttp import web

from server.bench.cli import build_parser, workload
from server.bench.client import Target, served_model
from server.bench.metrics import RequestResult, report, summarize
from server.bench.workload import (WorkloadError, arrival_offsets, jsonl_prompts,
                                   shared_prefix_prompts)
from server_harness import ROOT, ServerProcess, metric

# A: 3 tokens; B: 2 tokens, overlapping A; C: 1 token, starting as B ends; D: refused.
TRACE = [RequestResult(start=0.0, chunk_times=[0.1, 0.2, 0.4], end=0.6, prompt_tokens=10,
                       output_tokens=3),
         RequestResult(start=0.5, chunk_times=[0.8, 0.9], end=1.0, prompt_tokens=20,
                       output_tokens=2),
         RequestResult(start=1.0, chunk_times=[1.2], end=1.2, prompt_tokens=30,
                       output_tokens=1),
         RequestResult(start=0.2, end=0.3, error="HTTP 503: b'queue full'")]


def test_metrics_of_a_known_trace():
    s = summarize(TRACE, start=0.0, percentiles=[50, 99], slos_ms={"ttft": 250})
    assert (s["completed"], s["failed"]) == (3, 1)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (60, 6)
    assert s["duration"] == pytest.approx(1.2)
    assert s["request_throughput"] == pytest.approx(2.5)
    assert s["output_throughput"] == pytest.approx(5.0)
    assert s["total_token_throughput"] == pytest.approx(55.0)
    assert s["request_goodput"] == pytest.approx(2 / 1.2)  # TTFTs 100, 300, 200 ms
    assert s["max_concurrent_requests"] == 2  # C starts the instant B ends
    expected = {  # ms: TTFT [100, 300, 200]; TPOT [250, 200]; ITL [100, 200, 100];
        # E2EL [600, 500, 200]; p99 interpolates linearly between the two largest
        "ttft": (200, 200, 298), "tpot": (225, 225, 249.5),
        "itl": (400 / 3, 100, 198), "e2el": (1300 / 3, 500, 598)}
    for name, (mean, median, p99) in expected.items():
        assert s[f"mean_{name}_ms"] == pytest.approx(mean), name
        assert s[f"median_{name}_ms"] == pytest.approx(median), name
        assert s[f"p50_{name}_ms"] == pytest.approx(median), name
        assert s[f"p99_{name}_ms"] == pytest.approx(p99), name
    assert s["std_ttft_ms"] == pytest.approx((20000 / 3) ** 0.5)
    assert s["errors"] == ["HTTP 503: b'queue full'"]


def test_goodput_counts_requests_meeting_every_slo():
    both = summarize(TRACE, 0.0, [99], {"ttft": 250, "tpot": 220})
    assert both["request_goodput"] == pytest.approx(1 / 1.2)  # only C (no TPOT: 1 token)
    assert "request_goodput" not in summarize(TRACE, 0.0, [99])


def report_values(text: str) -> dict[str, str]:
    return dict(re.findall(r"^(.+?:)\s+(\S.*?)\s*$", text, re.M))


def test_report_uses_vllm_labels():
    s = summarize(TRACE, 0.0, [50, 99.9], {"e2el": 550})
    text = report(s, [50, 99.9], [12.5, 30.0])
    values = report_values(text)
    assert text.splitlines()[0] == "{:=^50}".format(" Serving Benchmark Result ")
    for section in ("Time to First Token", "Inter-token Latency", "End-to-end Latency",
                    "Time per Output Token (excl. 1st token)"):
        assert "{:-^50}".format(section) in text
    assert values["Successful requests:"] == "3"
    assert values["Failed requests:"] == "1"
    assert values["Benchmark duration (s):"] == "1.20"
    assert values["Request goodput (req/s):"] == "1.67"
    assert values["Output token throughput (tok/s):"] == "5.00"
    assert values["Mean TTFT (ms):"] == "200.00"
    assert values["Median ITL (ms):"] == "100.00"
    assert values["P50 TPOT (ms):"] == "225.00"
    assert values["P99.9 E2EL (ms):"] == f"{s['p99.9_e2el_ms']:.2f}"
    assert values["Client CPU per worker (%):"] == "12.5 30.0"
    assert "error: HTTP 503: b'queue full'" in text


def bench_args(*argv: str) -> Namespace:
    return build_parser().parse_args(list(argv))


def test_each_sweep_run_sends_new_prompts():
    for dataset in ("random", "shared-prefix"):
        args = bench_args("--dataset-name", dataset, "--num-prompts", "8", "--input-len", "32",
                          "--shared-prefix-len", "16", "--num-prefixes", "2")
        runs = [workload(args, run) for run in range(3)]
        assert runs[0] == workload(args, 0)  # seeded
        first_blocks = [{tuple(p.prompt[:16]) for p in prompts} for prompts in runs]
        assert not first_blocks[0] & first_blocks[1] and not first_blocks[1] & first_blocks[2]


def test_shared_prefix_groups():
    prompts = shared_prefix_prompts(6, input_len=20, output_len=3, prefix_len=12,
                                    num_prefixes=2, seed=1)
    assert all(len(p.prompt) == 20 and p.output_len == 3 for p in prompts)
    prefixes = [tuple(p.prompt[:12]) for p in prompts]
    assert prefixes[0::2] == [prefixes[0]] * 3 and prefixes[1::2] == [prefixes[1]] * 3
    assert prefixes[0] != prefixes[1]
    assert len({tuple(p.prompt[12:]) for p in prompts}) == 6
    with pytest.raises(WorkloadError, match="shared-prefix-len 20"):
        shared_prefix_prompts(2, 20, 3, prefix_len=20, num_prefixes=1, seed=0)


def test_jsonl_prompts_and_their_errors(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Hello there"}\n\n{"prompt": [1, 2, 3], "output_len": 7, '
                    '"source": "kept out"}\n{"prompt": "third"}\n')
    prompts = jsonl_prompts(path, 2, output_len=5)
    assert [(p.prompt, p.output_len) for p in prompts] == [("Hello there", 5), ([1, 2, 3], 7)]
    assert jsonl_prompts(path, 1, 5, skip=2)[0].prompt == "third"
    with pytest.raises(WorkloadError, match="holds 3 prompts; this run needs prompts 3..4"):
        jsonl_prompts(path, 2, 5, skip=2)
    for bad, why in (('{"text": "x"}', 'an object with a "prompt"'), ("[1, 2]", "an object"),
                     ('{"prompt": ""}', "non-empty string"), ("not json", "not JSON"),
                     ('{"prompt": [1, 99999]}', "token ids"),
                     ('{"prompt": "x", "output_len": 0}', "output_len")):
        path.write_text(bad + "\n")
        with pytest.raises(WorkloadError, match=re.escape(why)):
            jsonl_prompts(path, 1, 5)


def test_arrival_offsets():
    offsets = arrival_offsets(4000, rate=50.0, seed=0)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert offsets[-1] / 3999 == pytest.approx(1 / 50.0, rel=0.05)
    assert arrival_offsets(3, float("inf"), 0) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("argv, message", [
    (["--num-workers", "0"], "--num-workers must be >= 1"),
    (["--num-prompts", "2", "--num-workers", "3"], "exceeds --num-prompts"),
    (["--sweep-rates", "10,fast"], "--sweep-rates takes comma-separated numbers"),
    (["--sweep-rates", "10,0"], "--sweep-rates values must be in (0, inf]"),
    (["--dataset-name", "jsonl"], "--dataset-path goes with --dataset-name jsonl"),
    (["--dataset-name", "jsonl", "--dataset-path", "/nonexistent.jsonl"], "No such file"),
    (["--goodput", "ttft:fast"], "--goodput takes ttft:MS"),
    (["--percentiles", "0"], "--percentiles values must be in (0, 100]"),
])
def test_bad_arguments_are_one_clear_error(argv, message):
    proc = subprocess.run([sys.executable, "scripts/bench_serving.py", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_console_script_points_into_the_package():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = scripts["gpt2-bench"].partition(":")
    assert callable(getattr(import_module(module), function))


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    proc = ServerProcess(tiny_checkpoint, tmp_path_factory.mktemp("bench") / "server.log",
                         "--served-model-name", "gpt2", "--num-kv-blocks", "256")
    yield proc
    proc.stop()


def run_bench(server, tmp_path, *argv: str) -> tuple[str, dict]:
    result = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "scripts/bench_serving.py", "--base-url", server.url,
                           "--disable-tqdm", "--result-file", str(result), *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, json.loads(result.read_text())


def test_sweep_with_two_workers_sends_distinct_prompts(server, tmp_path):
    hits_before = metric(server.url, "vllm:prefix_cache_hits_total", model_name="gpt2")
    plot = tmp_path / "sweep.png"
    out, result = run_bench(server, tmp_path, "--sweep-rates", "40,inf", "--num-prompts", "6",
                            "--num-workers", "2", "--input-len", "40", "--output-len", "5",
                            "--plot", str(plot))
    assert result["model"] == "gpt2"
    assert [run["request_rate"] for run in result["runs"]] == ["40.0", "inf"]
    for run in result["runs"]:
        assert (run["completed"], run["failed"]) == (6, 0)
        assert (run["total_input_tokens"], run["total_output_tokens"]) == (240, 30)
        assert len(run["client_cpu_percent"]) == 2
        assert all(0 < cpu < 200 for cpu in run["client_cpu_percent"])
        assert 0 < run["median_ttft_ms"] <= run["p99_ttft_ms"]
    assert out.count("Mean TTFT (ms):") == 2 and out.count("Client worker processes:") == 2
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert metric(server.url, "vllm:prefix_cache_hits_total", model_name="gpt2") == hits_before
    replotted = tmp_path / "replotted.png"
    proc = subprocess.run([sys.executable, "scripts/bench_serving.py", "--replot",
                           str(tmp_path / "result.json"), "--plot", str(replotted)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert replotted.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_jsonl_run_with_cdf_plot(server, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Story number {i}:", "output_len": 3})
                               + "\n" for i in range(4)))
    plot = tmp_path / "cdf.png"
    out, result = run_bench(server, tmp_path, "--dataset-name", "jsonl", "--dataset-path",
                            str(prompts), "--num-prompts", "4", "--request-rate", "100",
                            "--plot", str(plot), "--percentiles", "50,90")
    run = result["runs"][0]
    assert (run["completed"], run["total_output_tokens"]) == (4, 12)
    assert run["total_input_tokens"] >= 4 * 3  # from the server's usage: text prompts
    assert "P90 ITL (ms):" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    proc = subprocess.run([sys.executable, "scripts/bench_serving.py", "--replot",
                           str(tmp_path / "result.json"), "--plot", str(tmp_path / "x.png")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "not a --sweep-rates result" in proc.stderr


def test_a_base_url_with_a_path_keeps_it():
    """A server behind a path prefix (a proxy's /gpt2/): requests go under it, as with httpx."""
    async def models(_request):
        return web.json_response({"data": [{"id": "behind-a-proxy"}]})

    async def check():
        app = web.Application()
        app.router.add_get("/gpt2/v1/models", models)
        runner = web.AppRunner(app)
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        await web.SockSite(runner, sock).start()
        try:
            return await served_model(f"http://127.0.0.1:{port}/gpt2", None)
        finally:
            await runner.cleanup()

    assert asyncio.run(check()) == "behind-a-proxy"


def test_a_worker_session_has_no_connection_cap_and_no_overall_timeout():
    """aiohttp's default caps a session at 100 connections: a worker's share of a burst must
    all be in flight at once, and a long stream must not time out."""
    async def settings():
        async with Target("http://127.0.0.1:1", "m").session() as session:
            return session.connector.limit, session.timeout.total, session.timeout.sock_connect

    assert asyncio.run(settings()) == (0, None, 30.0)
