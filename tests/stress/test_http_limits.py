"""The HTTP layer's limits (server/http_server.py) against the attacks they answer: an endless
header, slowloris at the file limit, silent and stalled connections, a client that never
reads; then SIGTERM's exit code (last: it ends the server).

The server here runs with 1 s timeouts, so each attack is cut within a few seconds."""
from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from server_harness import metric, wait_for

TIMEOUT = 1  # seconds: --header-timeout, --body-timeout and --write-timeout of `server`
MiB = 1 << 20


@pytest.fixture(scope="module")
def server(launch):
    return launch("--header-timeout", str(TIMEOUT), "--body-timeout", str(TIMEOUT),
                  "--write-timeout", str(TIMEOUT), "--num-kv-blocks", "1024")


def connect(server, timeout: float = 10) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=timeout)


def response_to(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (b"" for a reset)."""
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    return received


def test_an_endless_header_is_cut_while_others_are_served(server):
    """The header grows 256 KiB at a time; the server must hang up long before 64 MiB, and
    /health on another connection stays fast throughout (the parser never sees more than
    --max-header-bytes of it)."""
    chunk, sent, cut, slowest = b"a" * (256 << 10), 0, False, 0.0
    with connect(server) as attacker, httpx.Client(base_url=server.url, timeout=5) as http:
        attacker.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\nX-Endless: ")
        while sent < 64 * MiB and not cut:
            try:
                attacker.sendall(chunk)
                sent += len(chunk)
            except (ConnectionResetError, BrokenPipeError):
                cut = True
            if sent % MiB == 0 or cut:
                start = time.monotonic()
                assert http.get("/health").status_code == 200
                slowest = max(slowest, time.monotonic() - start)
        reply = b"" if cut else response_to(attacker)
    assert cut or reply.startswith(b"HTTP/1.1 431") or reply == b"", reply[:100]
    assert sent < 64 * MiB and slowest < 1.0, (sent, slowest)


def test_too_many_header_fields_are_a_431(server):
    def head(count: int) -> bytes:
        fields = b"".join(b"X-Field-%d: 1\r\n" % i for i in range(count))
        return b"GET /health HTTP/1.1\r\nHost: test\r\n" + fields + b"Connection: close\r\n\r\n"
    with connect(server) as sock:
        sock.sendall(head(97))  # 99 fields with Host and Connection: within the 100
        assert response_to(sock).startswith(b"HTTP/1.1 200")
    with connect(server) as sock:
        sock.sendall(head(101))
        reply = response_to(sock)
    assert reply.startswith(b"HTTP/1.1 431"), reply[:100]
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "too_many_headers"


def test_silent_and_trickling_connections_are_closed_at_the_header_timeout(server):
    """Silent since connecting: closed without a word. A head trickled a byte at a time:
    408, at the deadline counted from its first byte, however steady the trickle."""
    with connect(server) as silent:
        start = time.monotonic()
        assert response_to(silent) == b""
        assert TIMEOUT * 0.9 < time.monotonic() - start < TIMEOUT + 3
    with connect(server) as trickle:
        start = time.monotonic()
        for byte in b"GET /health HTTP/1.1\r\nHost: test\r\n":
            try:
                trickle.send(bytes([byte]))
            except OSError:
                break
            time.sleep(0.1)
        reply = response_to(trickle)
        assert time.monotonic() - start < TIMEOUT + 3
    assert reply.startswith(b"HTTP/1.1 408"), reply[:100]


HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"


@pytest.mark.parametrize("request_start", [
    HEAD + b"Content-Length: 100\r\n\r\n{\"prompt\"",  # a Content-Length never met
    HEAD + b"Transfer-Encoding: chunked\r\n\r\n9\r\n{\"prompt\"\r\n",  # a chunked body stalling
], ids=["content-length", "chunked"])
def test_a_stalled_body_gets_a_408(server, request_start):
    with connect(server) as sock:
        sock.sendall(request_start)
        start = time.monotonic()
        reply = response_to(sock)
        assert TIMEOUT * 0.9 < time.monotonic() - start < TIMEOUT + 3
    assert reply.startswith(b"HTTP/1.1 408"), reply[:100]
    assert metric(server.url, "vllm:num_requests_running") == 0


def test_clients_that_hang_up_mid_body_cost_no_traceback(server):
    before = server.log().count("Traceback")
    for _ in range(20):
        with connect(server) as sock:
            sock.sendall(HEAD + b"Content-Length: 1000\r\n\r\n{\"prompt\": \"abc")
    time.sleep(0.5)
    assert httpx.get(server.url + "/health").status_code == 200
    assert server.log().count("Traceback") == before


def test_a_slow_body_that_keeps_coming_is_not_cut(server):
    """The body deadline moves with each chunk: 2 s of chunks 0.3 s apart get through, and
    only the stall after them is cut."""
    with connect(server) as sock:
        sock.sendall(HEAD + b"Transfer-Encoding: chunked\r\n\r\n")
        until = time.monotonic() + 2 * TIMEOUT
        while time.monotonic() < until:
            sock.sendall(b"1\r\n \r\n")
            last_chunk = time.monotonic()
            time.sleep(0.3 * TIMEOUT)
        reply = response_to(sock)
        assert time.monotonic() - last_chunk > TIMEOUT * 0.9
    assert reply.startswith(b"HTTP/1.1 408"), reply[:100]


def test_a_client_that_never_reads_is_cut_and_its_sequences_aborted(server):
    """A stream to a client that reads nothing fills the socket soon (a tiny receive buffer
    and segment size keep the kernel's share near 130 KB; 20 logprobs make each token's event
    ~800 bytes); --write-timeout later the server cuts the connection and aborts its 16
    sequences, long before they would have ended."""
    prompts, max_tokens = 16, 1000
    generated = metric(server.url, "vllm:generation_tokens_total")
    body = json.dumps({"prompt": [[i, 2] for i in range(prompts)], "max_tokens": max_tokens,
                       "logprobs": 20, "ignore_eos": True, "stream": True}).encode()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
        sock.connect(("127.0.0.1", server.port))
        sock.sendall(HEAD + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        assert wait_for(lambda: metric(server.url, "vllm:num_requests_running") > 0)
        assert wait_for(lambda: metric(server.url, "vllm:num_requests_running") == 0,
                        timeout=TIMEOUT + 10)
        sock.settimeout(10)
        reply = response_to(sock)
    assert reply.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in reply
    assert metric(server.url, "vllm:generation_tokens_total") - generated < \
        0.9 * prompts * max_tokens
    assert "Traceback" not in server.log()


def test_slowloris_at_the_file_limit_does_not_lock_out_new_clients(launch):
    """600 connections that never finish their request line, against a server that may open
    512 files: the cap (512 minus the reserve) makes each new client close the longest-idle
    one, so new clients are served, and the log says so."""
    server = launch("--header-timeout", "60", "--num-kv-blocks", "64", rlimit_nofile=512)
    attackers = []
    try:
        for _ in range(600):
            attackers.append(connect(server, timeout=5))
            try:
                attackers[-1].sendall(b"GET /health HTT")
            except OSError:
                pass  # already closed to make room for a later one
        start = time.monotonic()
        for _ in range(20):  # each on a new connection
            assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        completion = httpx.post(server.url + "/v1/completions", timeout=10,
                                json={"prompt": "hi", "max_tokens": 2})
        assert completion.status_code == 200, completion.text
        assert time.monotonic() - start < 10
    finally:
        for sock in attackers:
            sock.close()
    assert "at the connection cap" in server.log()


def test_sigterm_ends_a_single_api_server_with_exit_code_0(server):
    """Last for `server`: it ends it."""
    assert server.stop() == 0
    assert "Finished server process" in server.log_path.read_text()
