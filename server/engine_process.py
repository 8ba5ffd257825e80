"""The engine core in a process of its own, so that its step loop never waits for the HTTP
side's per-token Python work (detokenizing, SSE, JSON) and vice versa: the parent's handle on
it (`EngineProcess`); the child runs server/core_main.py.

    API server i (uvicorn, EngineClient, CoreClient)      engine-core process (run_core_loop)
      PUSH ──AddSequences, AbortSequences, Shutdown──▶ PULL, bound at ipc://…/to_core
      PULL, bound at ipc://…/from_core_i ◀──StepOutput (one per step), CoreFailed── PUSH i
      startup: the core reports "ready" (or why not) over a pipe to its parent

One API server (the default) is the core's parent; with `--api-server-count N` the parent is
`gpt2-serve`'s supervisor (server/api_servers.py) and each of the N servers has its own
from_core socket. Every PUSH connects and every PULL binds, so a message sent before its
receiver is up waits in the sender's queue and a send never blocks.

Messages are msgspec Structs encoded as msgpack (engine/core/messages.py). The core process
dies with its parent (server/core_main.py).
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

import msgspec
import zmq

from engine.core.config import EngineConfig
from engine.core.messages import Shutdown
from server.core_main import core_main

logger = logging.getLogger("gpt2serve.engine")


class EngineStartupError(RuntimeError):
    """The engine core could not start; the message says why, in one line."""


@dataclass(frozen=True)
class CoreInfo:
    """What an API server needs to know of a ready core: its sockets, its process, and what
    it resolved at startup ("auto" settings) for the log and the admission checks."""
    to_core: str
    from_core: tuple[str, ...]  # one per API server
    pid: int
    max_model_len: int
    block_size: int
    max_num_seqs: int
    device: str
    dtype: str
    attention_backend: str
    num_kv_blocks: int
    pool_tokens: int
    startup_phases: str  # "process start 2.1 s, load 1.2 s, kernel table 0.1 s (cached), ..."


class EngineProcess:
    """Starts the core process for `num_clients` API servers and waits until it is ready: the
    model is loaded, the KV cache sized, the graphs captured. Raises EngineStartupError if it
    fails or exits."""

    def __init__(self, config: EngineConfig, num_clients: int = 1) -> None:
        self._dir = tempfile.mkdtemp(prefix="gpt2serve-")
        to_core = f"ipc://{self._dir}/to_core"
        from_core = tuple(f"ipc://{self._dir}/from_core_{i}" for i in range(num_clients))
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        report, child_report = context.Pipe(duplex=False)
        self._process = context.Process(
            target=core_main, name="engine-core", daemon=True,
            args=(config, to_core, from_core, child_report, os.getpid(),
                  logging.getLogger().level, time.time()))
        self._process.start()
        child_report.close()
        resolved = self._wait_ready(report)
        self.info = CoreInfo(to_core, from_core, self._process.pid,
                             config.scheduler.max_model_len, config.cache.block_size,
                             config.scheduler.max_num_seqs, **resolved)

    def _wait_ready(self, report: Connection) -> dict:
        while not report.poll(0.2):
            if not self._process.is_alive():
                shutil.rmtree(self._dir, ignore_errors=True)
                raise EngineStartupError(f"the engine core exited with code "
                                         f"{self._process.exitcode} before it was ready")
        try:
            kind, payload = report.recv()
        except EOFError:  # it died while reporting
            kind, payload = "error", "the engine core exited before it was ready"
        report.close()
        if kind != "ready":
            self._process.join(5)
            shutil.rmtree(self._dir, ignore_errors=True)
            raise EngineStartupError(payload)
        return payload

    @property
    def sentinel(self) -> int:
        return self._process.sentinel

    @property
    def exitcode(self) -> int | None:
        return self._process.exitcode

    def shutdown(self, timeout: float) -> None:
        """Send Shutdown and wait at most `timeout` seconds for the core to end (then kill
        it: a wedged core must not keep the server alive). Blocks: call it off the loop."""
        if self._process.is_alive():
            push = zmq.Context.instance().socket(zmq.PUSH)
            push.connect(self.info.to_core)
            push.send(msgspec.msgpack.encode(Shutdown()))
            push.close(linger=int(timeout * 1000))
            self._process.join(timeout)
        if self._process.is_alive():
            logger.warning("the engine core did not stop within %.1f s; killing it", timeout)
            self._process.kill()
            self._process.join(5)
        shutil.rmtree(self._dir, ignore_errors=True)


