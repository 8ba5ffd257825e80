"""Start `python -m server` in a subprocess on a free port (`ServerProcess`, or `serve` to run
it to its exit) and read its /metrics and its engine core's pid."""
from __future__ import annotations

import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


# a chat template for GPT-2, which ships none: "role: content" lines, then the reply's turn
CHAT_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"


def chat_server(checkpoint: Path, tmp_path_factory, *flags: str) -> ServerProcess:
    """A server named "tiny" with 256 KV blocks and CHAT_TEMPLATE, plus `flags`."""
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    return ServerProcess(checkpoint, tmp_path_factory.mktemp("srv") / "server.log",
                         "--served-model-name", "tiny", "--num-kv-blocks", "256",
                         "--chat-template", str(template), *flags)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    def __init__(self, checkpoint: Path, log_path: Path, *flags: str,
                 module: str = "server", rlimit_nofile: int | None = None) -> None:
        """`module`: what `python -m` runs; tests/stress/faulty_server.py wraps `server`.
        `rlimit_nofile`: the server's soft and hard limit on open files (default: ours)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [sys.executable, "-m", module, "--model", str(checkpoint),
                   "--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu",
                   "--dtype", "float32", "--attention-backend", "torch", "--log-interval",
                   "1", *flags]
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(command, cwd=ROOT, stdout=self._log,
                                     stderr=subprocess.STDOUT, env={**os.environ,
                                                                    "PYTHONUNBUFFERED": "1"},
                                     preexec_fn=None if rlimit_nofile is None else
                                     lambda: resource.setrlimit(resource.RLIMIT_NOFILE,
                                                                (rlimit_nofile, rlimit_nofile)))
        self._wait_healthy()

    def _wait_healthy(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server did not become healthy:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def metric(url: str, name: str, **labels: str) -> float:
    """The value of one sample in the /metrics text (0 when absent)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    for line in text.splitlines():
        match = re.match(r"^([^{\s]+)(\{[^}]*\})?\s+(\S+)$", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(match.group(3))
    return 0.0


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def serve(*argv: str) -> subprocess.CompletedProcess:
    """Run `python -m server` to its exit. The server binds before it loads: on a free port,
    unless the arguments name one."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # an unknown hub id fails fast, offline
    port = [] if "--port" in argv else ["--host", "127.0.0.1", "--port", str(free_port())]
    return subprocess.run([sys.executable, "-m", "server", *port, *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def core_pid(server: ServerProcess) -> int:
    """The engine core process's pid, as the server logs it at startup."""
    return int(re.search(r"engine core: pid (\d+)", server.log()).group(1))


def is_running(pid: int) -> bool:
    """Whether `pid` is alive (a zombie has exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] != "Z"
