"""`--api-server-count N` (N > 1): N API server processes in front of one engine core, for
when one process's per-token work (detokenizing, SSE, HTTP) cannot keep up with the engine.

    gpt2-serve (this process: binds the port, supervises)
      ├── engine-core process        (server/core_main.py)
      ├── API server 0 ─┐            each: uvicorn + EngineClient + CoreClient(i), accepting on
      ├── ...           ├─ the one listening socket, so the kernel spreads connections
      └── API server N-1┘            over them

- Each API server gets only its own sequences' outputs (server/client_router.py).
- Prometheus metrics live in a multiprocess directory, so /metrics on any server sums every
  server's request counters; API server 0 alone counts the engine's cumulative counters.
- SIGTERM or Ctrl-C here: SIGTERM to every API server (each drains as a single server does),
  then Shutdown to the core. The API servers sit in their own process group, so a Ctrl-C
  reaches them only through this process, once.
- An API server exiting on its own, or the core exiting, takes the others down (exit 1: the
  orchestrator restarts the pod). Each API server fails its open streams first, as a single
  one does; a hung core makes every API server exit once its watchdog gives up.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
from dataclasses import dataclass
from multiprocessing.connection import wait
from types import FrameType

from server.app import ServerSettings, create_app
from server.core_client import CoreClient
from server.engine_process import CoreInfo, EngineProcess
from server.processes import die_with_parent
from server.http_server import STREAM_END_GRACE, HttpLimits, serve_app

logger = logging.getLogger("gpt2serve")
CORE_STOP_TIMEOUT = 5.0  # seconds the core gets to stop once every API server has


@dataclass(frozen=True)
class ApiServerOptions:
    """What each API server process is started with (picklable, for the spawn)."""
    settings: ServerSettings
    host: str
    port: int
    log_level: str
    limits: HttpLimits = HttpLimits()


def run_api_servers(core: EngineProcess, sock: socket.socket, options: ApiServerOptions) -> int:
    """Serve on `sock` with len(core.info.from_core) API servers until SIGTERM or Ctrl-C;
    returns the exit code."""
    count = len(core.info.from_core)
    metrics_dir = tempfile.mkdtemp(prefix="gpt2serve-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # read by each server's import
    context = multiprocessing.get_context("spawn")
    servers = [context.Process(target=_api_server_main, name=f"api-server-{i}",
                               args=(i, sock, core.info, options)) for i in range(count)]
    for server in servers:
        server.start()
    sock.close()  # the servers hold their own copies
    logger.info("%d API servers (pids %s) accept on %s:%d", count,
                " ".join(str(server.pid) for server in servers), options.host, options.port)
    failed = _supervise(servers, core)
    _stop(servers, core, options.settings.shutdown_timeout)
    shutil.rmtree(metrics_dir, ignore_errors=True)
    return 1 if failed else 0


def _supervise(servers: list[multiprocessing.process.BaseProcess], core: EngineProcess) -> bool:
    """Wait for SIGTERM/SIGINT (False), or an API server's or the core's own exit (True)."""
    stop_requested = False

    def request_stop(sig: int, frame: FrameType | None) -> None:
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    watched = [server.sentinel for server in servers] + [core.sentinel]
    while not stop_requested:
        wait(watched, timeout=0.5)
        exited = [server for server in servers if server.exitcode is not None]
        if exited:
            logger.error("API server %s exited with code %s; stopping the others",
                         exited[0].name, exited[0].exitcode)
            return True
        if core.exitcode is not None:
            logger.error("the engine core exited with code %s; stopping the API servers",
                         core.exitcode)
            return True
    return False


def _stop(servers: list[multiprocessing.process.BaseProcess], core: EngineProcess,
          shutdown_timeout: float) -> None:
    for server in servers:
        if server.exitcode is None:
            server.terminate()  # SIGTERM: drain, as one server does
    for server in servers:
        server.join(shutdown_timeout + STREAM_END_GRACE + 2)
        if server.exitcode is None:
            logger.warning("API server %s did not stop in time; killing it", server.name)
            server.kill()
            server.join(5)
    core.shutdown(CORE_STOP_TIMEOUT)


def listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)  # uvicorn's backlog: connections queue until a server accepts
    return sock


def _api_server_main(index: int, sock: socket.socket, info: CoreInfo,
                     options: ApiServerOptions) -> None:
    die_with_parent()
    os.setpgid(0, 0)  # out of the terminal's process group: Ctrl-C goes to the supervisor
    logging.basicConfig(level=options.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s [api {index}] %(name)s: %(message)s")
    app = create_app(CoreClient(info, index), options.settings)
    sys.exit(serve_app(app, options.host, options.port, options.log_level,
                       options.settings.shutdown_timeout, sock, options.limits))
