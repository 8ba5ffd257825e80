"""Serving an app with uvicorn (uvloop and httptools), for one API server or each of N."""
from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from types import FrameType

import uvicorn
from fastapi import FastAPI

from server.engine_process import tune_gc

STREAM_END_GRACE = 1.0  # seconds


def serve_app(app: FastAPI, host: str, port: int, log_level: str, shutdown_timeout: float,
              sock: socket.socket | None = None) -> None:
    """Serve until SIGTERM or Ctrl-C, on `sock` when given (a socket several API servers
    accept on) or else on host:port. The app hears of the shutdown when it starts."""
    tune_gc()
    # uvicorn waits a little past the timeout: the app ends open streams at the timeout
    # itself, and they need a moment to send their error event and [DONE]
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout + STREAM_END_GRACE)
    _Server(config, app.state.begin_shutdown).run(None if sock is None else [sock])


class _Server(uvicorn.Server):
    """uvicorn's server, telling the app when SIGTERM (or Ctrl-C) starts the shutdown."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_shutdown = on_shutdown
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit and self._loop is not None:
            self._loop.call_soon_threadsafe(self._on_shutdown)
        super().handle_exit(sig, frame)
