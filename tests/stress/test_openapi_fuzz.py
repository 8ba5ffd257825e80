"""Schemathesis against the server's own /openapi.json: whatever it generates from the
schema, valid or not, the answer is never a 5xx. (The CLI, in a subprocess: schemathesis's
pytest plugin cannot load a schema from a fixture under pytest 9.)"""
from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

PROGRAM = "import sys; from schemathesis.cli import schemathesis; sys.exit(schemathesis())"


@pytest.fixture(scope="module")
def server(launch):
    """A 64-token context and n <= 2 bound the work any fuzzed completion can ask for."""
    return launch("--max-model-len", "64", "--max-n", "2", "--num-kv-blocks", "1024")


def test_the_schema_documents_every_request_body(server):
    """Bodies are parsed by hand (400s in OpenAI's shape), so FastAPI cannot infer them:
    without them in the schema, clients and fuzzers have nothing to build requests from."""
    paths = httpx.get(server.url + "/openapi.json").json()["paths"]
    posts = {path: ops["post"] for path, ops in paths.items() if "post" in ops}
    assert {"/v1/completions", "/tokenize", "/detokenize"} <= set(posts)
    assert [path for path, op in posts.items() if "requestBody" not in op] == []


@pytest.mark.slow
def test_no_generated_request_gets_a_5xx(server, tmp_path):
    report = tmp_path / "report.json"
    run = subprocess.run(
        [sys.executable, "-c", PROGRAM, "run", server.url + "/openapi.json",
         "--checks", "not_a_server_error", "--max-examples", "40", "--seed", "12",
         # one worker: CPython 3.11 counts AST recursion per interpreter, and hypothesis's
         # ast.parse in two threads at once can fail with "recursion depth mismatch"
         "--workers", "1", "--request-timeout", "60", "--no-color",
         "--report-json-path", str(report)],
        cwd=tmp_path, check=False, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    summary = json.loads(report.read_text())
    assert summary["complete"] and not summary["failures"] and not summary["errors"]
    assert summary["operations"]["tested"] == summary["operations"]["total"] >= 5
