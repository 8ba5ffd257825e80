"""CoreClient: one API server's connection to the engine-core process (the CoreConnection
`gpt2-serve` uses; server/engine_process.py draws the sockets).

The core's exit is watched through a pidfd, which works whether the core is this process's
child (one API server) or its sibling (`--api-server-count N`), and costs no syscall per
message: `is_alive` reads a flag the event loop sets when the pidfd turns readable.
"""
from __future__ import annotations

import asyncio
import logging
import os
import select
from collections.abc import Callable

import msgspec
import zmq

from engine.core.messages import CoreFailed, FromCore, ToCore
from server.engine_process import CoreInfo, EngineProcess

logger = logging.getLogger("gpt2serve.engine")


class CoreClient:
    def __init__(self, info: CoreInfo, client_index: int = 0,
                 owner: EngineProcess | None = None) -> None:
        """`owner`: the core's process when this API server started it (it then also stops
        it); None when a supervisor did (server/api_servers.py)."""
        self.info, self.client_index, self._owner = info, client_index, owner
        self.max_model_len, self.pool_tokens = info.max_model_len, info.pool_tokens
        self.block_size, self.max_num_seqs = info.block_size, info.max_num_seqs
        context = zmq.Context.instance()
        self._pull = context.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.bind(info.from_core[client_index])
        self._push = context.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)  # never drop: the core drains between steps
        self._push.connect(info.to_core)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromCore)
        self._pidfd = os.pidfd_open(info.pid)
        self._core_exited = _has_exited(self._pidfd)
        self._stopping = False

    def start(self, deliver: Callable[[FromCore], None]) -> None:
        loop = asyncio.get_running_loop()
        loop.add_reader(self._pull.getsockopt(zmq.FD), self._read_all, deliver)
        loop.add_reader(self._pidfd, self._on_exit, deliver)
        self._read_all(deliver)  # the FD is edge-triggered: take what came before

    def send(self, message: ToCore) -> None:
        if not self._core_exited and not self._push.closed:
            self._push.send(self._encoder.encode(message))

    def is_alive(self) -> bool:
        return not self._core_exited

    async def stop(self, timeout: float) -> None:
        """Stop the core if this server owns it (waiting at most `timeout` seconds); either
        way, close this server's sockets."""
        self._stopping = True
        if self._owner is not None:
            await asyncio.to_thread(self._owner.shutdown, timeout)
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._pidfd)
        loop.remove_reader(self._pull.getsockopt(zmq.FD))
        self._push.close(linger=0)
        self._pull.close(linger=0)
        os.close(self._pidfd)

    def _read_all(self, deliver: Callable[[FromCore], None]) -> None:
        """Deliver every message that has arrived, in one go: when the event loop falls
        behind the core, its streams then catch up several steps per chunk, rather than
        waking once per step."""
        while self._pull.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            deliver(self._decoder.decode(self._pull.recv(zmq.NOBLOCK)))

    def _on_exit(self, deliver: Callable[[FromCore], None]) -> None:
        asyncio.get_running_loop().remove_reader(self._pidfd)
        self._core_exited = True
        if self._stopping:
            return
        self._read_all(deliver)  # what the core sent before it died still counts
        code = "" if self._owner is None else f" (exit code {self._owner.exitcode})"
        deliver(CoreFailed(f"the engine core process exited unexpectedly{code}"))


def _has_exited(pidfd: int) -> bool:
    """A pidfd turns readable when its process exits."""
    return bool(select.select([pidfd], [], [], 0)[0])
