"""Schemathesis against the server's own /openapi.json: whatever it generates from the
schema, valid or not, the answer is never a 5xx. (The CLI, in a subprocess: schemathesis's
pytest plugin cannot load a schema from a fixture under pytest 9.)"""
from __future__ import annotations

import json
import subprocess
import sys

import httpx

PROGRAM = "import sys; from schemathesis.cli import schemathesis; sys.exit(schemathesis())"


def test_no_generated_request_gets_a_5xx(launch, tmp_path):
    # a 64-token context and n <= 2 bound the work any fuzzed completion can ask for
    server = launch("--max-model-len", "64", "--max-n", "2", "--num-kv-blocks", "1024")
    schema = httpx.get(server.url + "/openapi.json").json()
    # a schema without the body gives fuzzers (and clients) nothing to build requests from
    assert "requestBody" in schema["paths"]["/v1/completions"]["post"]
    report = tmp_path / "report.json"
    run = subprocess.run(
        [sys.executable, "-c", PROGRAM, "run", server.url + "/openapi.json",
         "--checks", "not_a_server_error", "--max-examples", "40", "--seed", "12",
         "--workers", "2", "--request-timeout", "60", "--no-color",
         "--report-json-path", str(report)],
        cwd=tmp_path, check=False, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    summary = json.loads(report.read_text())
    assert summary["complete"] and not summary["failures"] and not summary["errors"]
    assert summary["operations"]["tested"] == summary["operations"]["total"] >= 5
