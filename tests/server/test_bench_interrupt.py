"""Ctrl-C in gpt2-bench: the report of the requests finished so far, no traceback."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

from server_harness import ROOT, ServerProcess, metric, wait_for

NUM_PROMPTS = 400  # at 20 req/s: 20 s, far longer than the test lets it run


def report_values(text: str) -> dict[str, str]:
    return dict(re.findall(r"^(.+?:)\s+(\S+)\s*$", text, re.MULTILINE))


def default_sigint() -> None:
    """In the bench's process before it starts: SIGINT as a terminal's foreground job has it.
    A test run started in the background inherits it ignored, and Python keeps an ignored
    SIGINT ignored (no KeyboardInterrupt): the bench would never see the Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_reports_the_requests_finished_so_far(tiny_checkpoint, tmp_path):
    """SIGINT to the whole process group, as a terminal's Ctrl-C sends it (the client
    workers get it too), once the server has finished a few requests."""
    server = ServerProcess(tiny_checkpoint, tmp_path / "server.log")
    result_file = tmp_path / "result.json"
    try:
        bench = subprocess.Popen(
            [sys.executable, "-m", "server.bench.cli", "--base-url", server.url,
             "--num-prompts", str(NUM_PROMPTS), "--request-rate", "20", "--input-len", "8",
             "--output-len", "16", "--num-workers", "2", "--disable-tqdm",
             "--result-file", str(result_file)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True, preexec_fn=default_sigint)
        # the warm-up request and at least three of the run's
        assert wait_for(lambda: metric(server.url, "vllm:request_success_total",
                                       finished_reason="length") >= 4, timeout=120)
        os.killpg(bench.pid, signal.SIGINT)
        out, err = bench.communicate(timeout=60)
    finally:
        server.stop()
    assert bench.returncode == 130, (out, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    finished = int(re.search(rf"interrupted: (\d+) of {NUM_PROMPTS} requests finished",
                             out).group(1))
    assert 1 <= finished < NUM_PROMPTS
    values = report_values(out)
    assert values["Successful requests:"] == str(finished)
    assert values["Failed requests:"] == "0"
    assert values["Total generated tokens:"] == str(16 * finished)
    (run,) = json.loads(result_file.read_text())["runs"]
    assert run["interrupted"] is True and run["completed"] == finished
