"""The engine core loop in a thread of the server's process: the CoreConnection tests use
(no second process to start, faults injected into the core object directly). `gpt2-serve`
runs the core in a process of its own (server/engine_process.py).

    event loop ──send(): queue.Queue──────────────────────▶ core thread (run_core_loop)
    event loop ◀──loop.call_soon_threadsafe(deliver, msg)── core thread
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable

from engine.core.engine_core import EngineCore, run_core_loop
from engine.core.messages import FromCore, Shutdown, ToCore

logger = logging.getLogger("gpt2serve.engine")


class CoreThread:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.max_model_len = core.config.scheduler.max_model_len
        self.pool_tokens = core.block_manager.num_tokens
        self.block_size = core.block_manager.block_size
        self.max_num_seqs = core.config.scheduler.max_num_seqs
        self.client_index = 0
        self._inbox: queue.Queue[ToCore] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="engine-core", daemon=True)
        self._deliver: Callable[[FromCore], None] = lambda message: None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, deliver: Callable[[FromCore], None]) -> None:
        self._loop, self._deliver = asyncio.get_running_loop(), deliver
        self._thread.start()

    def send(self, message: ToCore) -> None:
        self._inbox.put(message)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    async def stop(self, timeout: float) -> None:
        """Send Shutdown, then wait (off the event loop) at most `timeout` seconds."""
        if self.is_alive():
            self.send(Shutdown())
            await asyncio.to_thread(self._thread.join, timeout)
        if self.is_alive():
            logger.warning("the engine core did not stop within %.1f s; leaving without it",
                           timeout)

    def _run(self) -> None:
        run_core_loop(self.core, self._receive, self._send)

    def _receive(self, timeout: float) -> list[ToCore]:
        messages = []
        try:
            messages.append(self._inbox.get(timeout=timeout) if timeout else
                            self._inbox.get_nowait())
            while True:
                messages.append(self._inbox.get_nowait())
        except queue.Empty:
            return messages

    def _send(self, message: FromCore) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._deliver, message)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass
