"""gpt2-bench's client worker (server/bench/client.py) against a stub SSE server: what a
worker saw goes back to the parent whole, however large."""
from __future__ import annotations

import multiprocessing as mp
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from server.bench.client import Target, WorkerJob, _worker
from server.bench.workload import Prompt

# ~1 MB of chunk times pickled: several times a pipe's buffer
CHUNKS = 120_000
BODY = (b'data: {"choices":[{"text":"x"}]}\n\n' * CHUNKS
        + b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":%d}}\n\n'
        % CHUNKS + b"data: [DONE]\n\n")
PARENT_DELAY_S = 0.5  # the parent reads the outcome only this long after the worker is done


class StubStream(BaseHTTPRequestHandler):
    """Answers every POST with BODY, then closes the connection (HTTP/1.0)."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(BODY)

    def log_message(self, *args) -> None:
        pass


def test_a_worker_hands_back_a_result_larger_than_the_pipe():
    """`_worker` as a worker process runs it (here in this process, the parent's side in a
    thread that reads the outcome late, as a parent busy with another worker does): its
    results go down the pipe it listened on for "stop" while its event loop ran, so that
    pipe must be blocking again, or the send fails with BlockingIOError."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), StubStream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    parent_end, child_end = mp.Pipe()
    received = []

    def parent() -> None:
        assert parent_end.recv() == "ready"
        parent_end.send(time.monotonic())
        while not parent_end.poll(0.01):
            pass  # the worker is sending requests
        time.sleep(PARENT_DELAY_S)
        received.append(parent_end.recv())

    reader = threading.Thread(target=parent, daemon=True)
    reader.start()
    sigint = signal.getsignal(signal.SIGINT)  # _worker ignores SIGINT
    try:
        job = WorkerJob(Target(f"http://127.0.0.1:{server.server_address[1]}", "stub"),
                        [Prompt([1, 2, 3], CHUNKS)], [0.0], None)
        _worker(job, child_end, mp.Value("i", 0))
        reader.join(timeout=30)
    finally:
        signal.signal(signal.SIGINT, sigint)
        server.shutdown()
        server.server_close()
    (outcome,) = received
    (result,) = outcome.results
    assert result.ok, result.error
    assert len(result.chunk_times) == result.output_tokens == CHUNKS
