"""Serving an app with uvicorn (uvloop and httptools), for one API server or each of N, under
limits that keep one client from holding the event loop, memory or file descriptors.

Each API server process enforces, per connection (flags from `add_http_flags`, defaults in
`HttpLimits`):

    --max-header-bytes    request line + headers, counted as bytes arrive     431, close
    --max-headers         header fields of one request                        431, close
    --header-timeout      connect (or a keep-alive request's first byte)
                          to the end of the headers                            408, close
    --body-timeout        a request body without progress                     408, close
    --write-timeout       a response the client does not read (send buffer
                          full): the connection is cut, the request aborted
    --timeout-keep-alive  an idle keep-alive connection is closed
    --max-connections     open connections, at most the file limit minus
                          FILE_RESERVE; at the cap a new connection closes the
                          longest-idle one (no request in progress), or with
                          none idle gets 503 and is closed; one warning per
                          CAP_WARNING_INTERVAL says how often

The soft file limit is raised to the hard one at startup. SIGTERM or Ctrl-C shuts down
gracefully and `serve_app` returns 0; `app.state.stop_server(code)` does the same and makes
`serve_app` return `code`.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import http
import json
import logging
import math
import resource
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, ClassVar

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from server.processes import tune_gc
from server.protocol import RequestError

logger = logging.getLogger("gpt2serve")
STREAM_END_GRACE = 1.0  # seconds
FILE_RESERVE = 128  # descriptors for the process's own files (about 30) and accept bursts
CAP_WARNING_INTERVAL = 10.0  # seconds between two warnings that the connection cap was hit


@dataclasses.dataclass(frozen=True)
class HttpLimits:
    """What one client may take from an API server process; every value must be > 0."""
    # request line + headers: 8x nginx's 8 KiB, room for long URLs, keys and proxies' headers
    max_header_bytes: int = 64 * 1024
    max_headers: int = 100  # header fields per request, as Python's http.client allows
    header_timeout: float = 10.0  # seconds to send the headers: ample for any real client
    body_timeout: float = 30.0  # seconds a request body may stall: a mobile uplink's hiccup
    # seconds a response may sit unread: long enough for a slow reader, and then a stalled
    # one's buffers (MBs) are freed
    write_timeout: float = 30.0
    timeout_keep_alive: float = 5.0  # seconds an idle keep-alive connection stays (uvicorn's)
    max_connections: int = 8192  # per process: 1000+ streams at once fit several times over

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            if not getattr(self, field.name) > 0:
                raise ValueError(f"HttpLimits.{field.name} must be > 0, got "
                                 f"{getattr(self, field.name)!r}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> HttpLimits:
        """From the flags `add_http_flags` added (argparse already refused values <= 0)."""
        return cls(**{field.name: getattr(args, field.name)
                      for field in dataclasses.fields(cls)})


def add_http_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per HttpLimits field, named as the field; a value <= 0 is a parser error."""
    defaults = HttpLimits()
    group = parser.add_argument_group("HTTP limits (per API server process)")

    def flag(name: str, kind: type, help_text: str) -> None:
        default = getattr(defaults, name)
        group.add_argument("--" + name.replace("_", "-"), dest=name, type=_positive(kind),
                           default=default, help=f"{help_text} (default: {default})")

    flag("max_header_bytes", int, "bytes of a request's request line and headers; more: 431 "
         "and the connection is closed")
    flag("max_headers", int, "header fields of one request; more: 431 and the connection is "
         "closed")
    flag("header_timeout", float, "seconds from connecting (or from a keep-alive request's "
         "first byte) to the end of the headers; then 408 and the connection is closed")
    flag("body_timeout", float, "seconds a request body may go without progress; then 408 "
         "and the connection is closed")
    flag("write_timeout", float, "seconds a client may leave a response unread (the send "
         "buffer full); then the connection is cut and its request aborted")
    flag("timeout_keep_alive", float, "seconds an idle keep-alive connection stays open")
    flag("max_connections", int, f"open connections, at most the file limit minus "
         f"{FILE_RESERVE}; at the cap a new connection closes the longest-idle one, or gets "
         f"503 when none is idle")


def _positive(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names it in "invalid int value: 'x'"
    return parse


def serve_app(app: FastAPI, host: str, port: int, log_level: str, shutdown_timeout: float,
              sock: socket.socket | None = None, limits: HttpLimits = HttpLimits()) -> int:
    """Serve until SIGTERM, Ctrl-C or `app.state.stop_server(exit_code)`, on `sock` when
    given (a socket several API servers accept on) or else on host:port; returns the exit
    code: 0 after a signal, else the first non-zero code given to stop_server. The app hears
    of the shutdown (app.state.begin_shutdown) when it starts."""
    tune_gc()
    cap = _ConnectionCap(_connection_cap(limits.max_connections))
    protocol = type("HttpProtocol", (_GuardedProtocol,), {"limits": limits, "cap": cap})
    # uvicorn waits a little past the timeout: the app ends open streams at the timeout
    # itself, and they need a moment to send their error event and [DONE]
    # ws="none": no WebSocket routes, so an Upgrade request stays plain HTTP, under the limits
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol,
                            ws="none", timeout_keep_alive=limits.timeout_keep_alive,
                            timeout_graceful_shutdown=shutdown_timeout + STREAM_END_GRACE)
    server = _Server(config, app.state.begin_shutdown)
    app.state.stop_server = server.stop
    server.run(None if sock is None else [sock])
    return server.exit_code


def raise_file_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit (as vLLM does), so
    that thousands of connections fit; returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            logger.warning("could not raise the open-file limit from %d to %d: %s", soft,
                           hard, exc)
    return soft


def _connection_cap(max_connections: int) -> int:
    """max_connections, lowered (with a warning) to what the file limit leaves room for."""
    files = raise_file_limit()
    if files == resource.RLIM_INFINITY or max_connections <= files - FILE_RESERVE:
        return max_connections
    cap = max(1, files - FILE_RESERVE)
    logger.warning("at most %d open connections (--max-connections %d): the open-file limit "
                   "is %d; raise it (ulimit -n) for more", cap, max_connections, files)
    return cap


class _ConnectionCap:
    """At most `limit` open connections. At the limit, admitting one closes the connection
    idle the longest (no request in progress: before its headers or between keep-alive
    requests); with none idle, the new one is refused."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: set[_GuardedProtocol] = set()
        self._idle: dict[_GuardedProtocol, None] = {}  # in order: the longest idle first
        self._closed = self._refused = 0  # since the last warning
        self._warned_at = -math.inf

    def admit(self, conn: _GuardedProtocol) -> bool:
        if len(self._open) >= self.limit and not self._make_room():
            return False
        self._open.add(conn)
        self._idle[conn] = None
        return True

    def idle(self, conn: _GuardedProtocol) -> None:
        if conn in self._open:
            self._idle.pop(conn, None)
            self._idle[conn] = None

    def busy(self, conn: _GuardedProtocol) -> None:
        self._idle.pop(conn, None)

    def drop(self, conn: _GuardedProtocol) -> None:
        self._open.discard(conn)
        self._idle.pop(conn, None)

    def _make_room(self) -> bool:
        victim = next(iter(self._idle), None)
        if victim is None:
            self._refused += 1
        else:
            self.drop(victim)
            victim.transport.close()
            self._closed += 1
        self._warn()
        return victim is not None

    def _warn(self) -> None:
        now = time.monotonic()
        if now - self._warned_at < CAP_WARNING_INTERVAL:
            return
        logger.warning("at the connection cap (%d open): since the last such warning, "
                       "closed %d idle connections to make room and refused %d new ones "
                       "(503); see --max-connections and the open-file limit", self.limit,
                       self._closed, self._refused)
        self._warned_at, self._closed, self._refused = now, 0, 0


class _Refused(Exception):
    """Raised in a parser callback to stop parsing; uvicorn then calls send_400_response."""


class _GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol under `limits` and `cap` (set by a subclass per server).

    A connection alternates between reading a head (request line and headers; bytes counted
    before the parser sees them, the header deadline running) and the rest of a request
    (its body, the body deadline moving with each chunk; then its response). A connection
    with a head to read and no response in flight is idle, for the cap."""
    limits: ClassVar[HttpLimits]
    cap: ClassVar[_ConnectionCap]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # the next bytes belong to a request line or headers
        self._head_bytes = 0
        self._refusal: tuple[int, str, str] | None = None  # why a callback stopped the parser
        self._read_deadline: float | None = None  # loop time the head or body must arrive by
        self._read_timer: asyncio.TimerHandle | None = None  # due at or before the deadline
        self._read_timer_at = math.inf
        self._write_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if not self.cap.admit(self):
            self._refuse(503, "too_many_connections", "the server has too many open "
                         "connections; retry shortly")
            return
        self._read_by(self.limits.header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self.cap.drop(self)
        self._read_deadline = None
        for timer in (self._read_timer, self._write_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """Feeds a head at most max_header_bytes at a time, so an endless one is refused
        after that many bytes, before the parser buffers more."""
        while data and not self.transport.is_closing():
            if not self._in_head:
                super().data_received(data)
                return
            room = self.limits.max_header_bytes - self._head_bytes
            if room <= 0:
                self._refuse(431, "headers_too_large", f"the request line and headers are "
                             f"over {self.limits.max_header_bytes} bytes")
                return
            if self._read_deadline is None:  # a keep-alive request's first byte
                self._read_by(self.limits.header_timeout)
            piece, data = data[:room], data[room:]
            self._head_bytes += len(piece)
            super().data_received(piece)

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(self.headers) >= self.limits.max_headers:
            self._refusal = (431, "too_many_headers",
                             f"more than {self.limits.max_headers} header fields")
            raise _Refused
        super().on_header(name, value)

    def send_400_response(self, msg: str) -> None:
        if self._refusal is None:
            super().send_400_response(msg)
        else:
            self._refuse(*self._refusal)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self.cap.busy(self)
        self._read_by(self.limits.body_timeout)
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        self._read_deadline = self.loop.time() + self.limits.body_timeout

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head, self._head_bytes, self._read_deadline = True, 0, None
        if not self._responding():
            self.cap.idle(self)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._in_head and not self._responding() and not self.transport.is_closing():
            self.cap.idle(self)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.limits.write_timeout,
                                                     self._write_timed_out)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _responding(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _read_by(self, seconds: float) -> None:
        """The head or body must arrive within `seconds` from now. A later deadline only
        moves the number: the pending timer finds it when it fires (no timer per chunk)."""
        self._read_deadline = deadline = self.loop.time() + seconds
        if self._read_timer_at > deadline:
            self._arm_read_timer(deadline)

    def _arm_read_timer(self, when: float) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        self._read_timer = self.loop.call_at(when, self._check_read_deadline)
        self._read_timer_at = when

    def _check_read_deadline(self) -> None:
        self._read_timer, self._read_timer_at = None, math.inf
        if self._read_deadline is None or self.transport.is_closing():
            return
        if self.flow.read_paused or (self._in_head and self._responding()):
            # it waits for us: we stopped reading, or a pipelined head waits for a response
            self._read_by(self.limits.header_timeout if self._in_head
                          else self.limits.body_timeout)
        elif self.loop.time() < self._read_deadline:
            self._arm_read_timer(self._read_deadline)
        else:
            self._read_timed_out()

    def _read_timed_out(self) -> None:
        if not self._in_head:
            self._refuse(408, "request_timeout", f"no request body bytes for "
                         f"{self.limits.body_timeout:g} s")
        elif self._head_bytes:
            self._refuse(408, "request_timeout", f"the headers did not arrive within "
                         f"{self.limits.header_timeout:g} s")
        else:
            self.transport.close()  # silent since it connected: nobody to answer

    def _write_timed_out(self) -> None:
        self._write_timer = None
        logger.debug("a client left its response unread for %g s; cutting the connection",
                     self.limits.write_timeout)
        self.transport.abort()

    def _refuse(self, status: int, code: str, message: str) -> None:
        """Answer `status` (unless the request at hand was answered already, or the one
        before is still being answered) and close; a request in progress sees a disconnect."""
        cycle = self.cycle  # while reading a head: the previous request's, if any
        if cycle is None or (cycle.response_complete if self._in_head
                             else not cycle.response_started):
            self.transport.write(_error_response(status, code, message,
                                                 self.server_state.default_headers))
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app's later sends are dropped
            cycle.message_event.set()
        self.transport.close()


def _error_response(status: int, code: str, message: str,
                    default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """A complete `connection: close` response with OpenAI's error body."""
    err_type = "service_unavailable" if status == 503 else "invalid_request_error"
    body = json.dumps(RequestError(message, code=code, status=status,
                                   err_type=err_type).body()).encode()
    headers = list(default_headers) + [(b"content-type", b"application/json"),
                                       (b"content-length", str(len(body)).encode()),
                                       (b"connection", b"close")]
    if status == 503:
        headers.append((b"retry-after", b"1"))
    head = f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n".encode()
    return head + b"".join(name + b": " + value + b"\r\n" for name, value in headers) + \
        b"\r\n" + body


class _Server(uvicorn.Server):
    """uvicorn's server, telling the app when a shutdown starts, and stoppable from the app
    with an exit code. A signal ends it with exit code 0: uvicorn's own re-raising of the
    signal after the graceful shutdown (exit status 143 for SIGTERM) is left out."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_shutdown = on_shutdown
        self._loop: asyncio.AbstractEventLoop | None = None
        self.exit_code = 0

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def stop(self, exit_code: int) -> None:
        """Shut down gracefully, as SIGTERM does; call it on the server's event loop. The
        first non-zero code given is the exit code."""
        self.exit_code = self.exit_code or exit_code
        if not self.should_exit:
            self.should_exit = True
            self._on_shutdown()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit and self._loop is not None:
            self._loop.call_soon_threadsafe(self._on_shutdown)
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """SIGINT and SIGTERM call handle_exit while serving; nothing is re-raised after."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)
