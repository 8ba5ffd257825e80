"""What a new user runs: a checkpoint made without transformers, the README's curl and
openai examples verbatim against a quickstart-style server (random weights served under the
name `gpt2`), the dashboard's metrics, and the container's health check."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from server.healthcheck import health_url, is_server
from server_harness import ROOT, ServerProcess

README = (ROOT / "README.md").read_text()
DASHBOARD = ROOT / "deploy/compose/grafana/dashboards/gpt2-serve.json"


def test_make_checkpoint_needs_no_transformers(tmp_path):
    code = ("import sys; sys.modules['transformers'] = None; "  # any import of it now fails
            "sys.argv = ['make_checkpoint', '--n-layer', '1', '--n-embd', '32', '--n-head', "
            f"'4', '--out', {str(tmp_path)!r}]; "
            "import runpy; runpy.run_path('scripts/make_checkpoint.py', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["model_type"], config["n_layer"], config["n_embd"]) == ("gpt2", 1, 32)
    assert (tmp_path / "model.safetensors").stat().st_size > 50257 * 32 * 4


def test_make_checkpoint_rejects_a_bad_shape(tmp_path):
    proc = subprocess.run([sys.executable, "scripts/make_checkpoint.py", "--n-embd", "66",
                           "--n-head", "4", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "n_embd divisible by n_head" in proc.stderr


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    """As scripts/quickstart.sh serves random weights: under the name the user asked for."""
    proc = ServerProcess(tiny_checkpoint, tmp_path_factory.mktemp("quick") / "server.log",
                         "--served-model-name", "gpt2")
    yield proc
    proc.stop()


def readme_example(pattern: str) -> str:
    match = re.search(pattern, README, re.S)
    assert match, f"README lost its example {pattern!r}"
    return match.group(1).replace("localhost:8000", "127.0.0.1:PORT")


def test_readme_curl_example_gets_200(server):
    command = readme_example(r"\n    (curl localhost:8000/v1/completions.*?\}')\n")
    command = command.replace("\\\n", " ").replace("PORT", str(server.port))
    proc = subprocess.run(["bash", "-c", command + " -sS -w '\\n%{http_code}'"],
                          capture_output=True, text=True, timeout=120)
    body, status = proc.stdout.rsplit("\n", 1)
    assert (proc.returncode, status) == (0, "200"), proc.stdout + proc.stderr
    assert body.rstrip().endswith("data: [DONE]")
    chunks = [json.loads(line[6:]) for line in body.splitlines()
              if line.startswith("data: {")]
    assert chunks and all(chunk["model"] == "gpt2" for chunk in chunks)


def test_readme_openai_example_runs(server):
    code = readme_example(r"```python\n(from openai import OpenAI.*?)```")
    code = code.replace("PORT", str(server.port))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()  # 16 tokens of (random-weight) text


def test_every_metric_the_dashboard_queries_is_exported(server):
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    queries += [var["query"]["query"] for var in dashboard["templating"]["list"]]
    wanted = {name for query in queries for name in re.findall(r"vllm:[a-z0-9_]+", query)}
    assert len(wanted) >= 10
    subprocess.run(["curl", "-sS", f"{server.url}/v1/completions", "-H",
                    "content-type: application/json", "-d",
                    '{"model": "gpt2", "prompt": "Hi", "max_tokens": 3}'],
                   check=True, capture_output=True, timeout=60)
    exported = subprocess.run(["curl", "-sS", f"{server.url}/metrics"], check=True,
                              capture_output=True, text=True, timeout=60).stdout
    samples = {line.split("{")[0].split(" ")[0] for line in exported.splitlines()
               if line.startswith("vllm:")}
    assert not wanted - samples, f"queried but not exported: {sorted(wanted - samples)}"
    for panel in ("Time to first token", "Inter-token latency", "End-to-end request latency",
                  "Requests running and waiting", "KV-cache usage", "Prefix-cache hit rate",
                  "Preemptions"):
        assert panel in {p["title"] for p in dashboard["panels"]}


def test_healthcheck_follows_the_servers_port(server):
    proc = subprocess.run([sys.executable, "-m", "server.healthcheck", str(server.proc.pid)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert is_server([sys.executable, "-m", "server", "--port", "1"])
    assert is_server(["/opt/venv/bin/python3", "/opt/venv/bin/gpt2-serve", "--model", "gpt2"])
    assert not is_server(["python3", "-m", "server.healthcheck"])
    assert health_url(["gpt2-serve", "--port=9001"]) == "http://127.0.0.1:9001/health"
    assert health_url(["gpt2-serve", "--host", "::1"]) == "http://[::1]:8000/health"
    assert health_url(["gpt2-serve", "--host", "10.1.2.3", "--port", "7"]) == \
        "http://10.1.2.3:7/health"


def test_healthcheck_fails_when_nothing_answers(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                                "--port", "1"])
    try:
        proc = subprocess.run([sys.executable, "-m", "server.healthcheck", str(sleeper.pid)],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert proc.returncode == 1
    assert "http://127.0.0.1:1/health" in proc.stderr
