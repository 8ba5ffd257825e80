"""scripts/serve_noop_core.py: the server with bench_host's NoOpRunner in its engine core, the
CPU tool that measures the API processes alone, runs with several API servers."""
from __future__ import annotations

import json

import httpx
import pytest

from server_harness import ROOT, ServerProcess


@pytest.mark.slow
def test_the_no_op_core_streams_through_two_api_servers(tiny_checkpoint, tmp_path,
                                                         monkeypatch):
    # `python -m serve_noop_core` finds the script and its sibling bench_host.py as
    # `python scripts/serve_noop_core.py` does
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "scripts"))
    server = ServerProcess(tiny_checkpoint, tmp_path / "server.log", "--num-kv-blocks", "256",
                           "--api-server-count", "2", module="serve_noop_core")
    body = {"prompt": "hello", "max_tokens": 9, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    try:
        with httpx.stream("POST", server.url + "/v1/completions", json=body,
                          timeout=60) as response:
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 9
    finally:
        assert server.stop() == 0
