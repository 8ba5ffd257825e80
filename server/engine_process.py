"""The engine core in a process of its own, so that its ~1 ms step loop never waits for the
HTTP side's per-token Python work (detokenizing, SSE, JSON) and vice versa.

    API process (uvicorn, AsyncEngine)                  engine-core process (run_core_loop)
      PUSH ipc://…/to_core   ──AddSequences, AbortSequences, Shutdown──▶ PULL
      PULL ipc://…/from_core ◀──StepOutput (one per step), CoreFailed── PUSH
      startup: the core reports "ready" (or why not) over a pipe before the server listens

Messages are msgspec Structs encoded as msgpack (engine/core/messages.py). The core process
dies with the server: the kernel kills it when its parent dies (PR_SET_PDEATHSIG), and its idle
loop checks its parent too. It ignores SIGINT: a Ctrl-C reaches the whole process group, and
the server's shutdown (drain, then Shutdown) decides when the core stops.
"""
from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

import msgspec
import zmq

from engine.core.config import EngineConfig
from engine.core.messages import CoreFailed, FromCore, ToCore
from server.async_engine import stop_core

PARENT_CHECK_MS = 1000  # how often an idle core looks for its parent
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # both processes log alike
SEND_TIMEOUT_MS = 1000  # a live core drains its inbox between steps; longer means it is stuck
logger = logging.getLogger("gpt2serve.engine")


# Both processes allocate several objects per sequence per step, and CPython's default
# collection threshold (700 allocations) then runs a collection every few hundred tokens,
# each walking the live requests' state. With these, the API process streamed 18k instead of
# 10k tok/s on the dev CPU against a no-op engine core (600 streams of 128 tokens).
GC_THRESHOLDS = (100_000, 50, 1000)


def tune_gc() -> None:
    """Collect rarely, and never walk what startup built (the model, the tokenizer)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


class EngineStartupError(RuntimeError):
    """The engine core could not start; the message says why, in one line."""


@dataclass(frozen=True)
class CoreInfo:
    """What the core resolved at startup ("auto" settings), for the server's log and checks."""
    device: str
    dtype: str
    attention_backend: str
    num_kv_blocks: int
    pool_tokens: int
    startup_phases: str  # "load 1.2 s, skinny table 0.1 s (cached), ..."


class EngineProcess:
    """Starts the core process and waits until it is ready: the model is loaded, the KV cache
    sized, the graphs captured. Raises EngineStartupError if it fails or exits."""

    def __init__(self, config: EngineConfig) -> None:
        self.max_model_len = config.scheduler.max_model_len
        self._dir = tempfile.mkdtemp(prefix="gpt2serve-")
        self._to_core = f"ipc://{self._dir}/to_core"
        self._from_core = f"ipc://{self._dir}/from_core"
        # bound before the core starts, which connects before it reports ready: nothing sent
        # after "ready" can miss it
        self._push = zmq.Context.instance().socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)  # never drop: the core drains between steps
        self._push.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        self._push.bind(self._to_core)
        self._pull = zmq.Context.instance().socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.bind(self._from_core)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromCore)
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        report, child_report = context.Pipe(duplex=False)
        self._process = context.Process(
            target=_core_main, name="engine-core", daemon=True,
            args=(config, self._to_core, self._from_core, child_report, os.getpid(),
                  logging.getLogger().level))
        self._process.start()
        child_report.close()
        self.info = self._wait_ready(report)
        self.pool_tokens = self.info.pool_tokens
        self._stopping = False

    def _wait_ready(self, report: Connection) -> CoreInfo:
        while not report.poll(0.2):
            if not self._process.is_alive():
                self._cleanup()
                raise EngineStartupError(f"the engine core exited with code "
                                         f"{self._process.exitcode} before it was ready")
        kind, payload = report.recv()
        report.close()
        if kind != "ready":
            self._process.join(5)
            self._cleanup()
            raise EngineStartupError(payload)
        return CoreInfo(**payload)

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def start(self, deliver: Callable[[FromCore], None]) -> None:
        loop = asyncio.get_running_loop()
        loop.add_reader(self._pull.getsockopt(zmq.FD), self._read_all, deliver)
        loop.add_reader(self._process.sentinel, self._on_exit, deliver)
        self._read_all(deliver)  # the FD is edge-triggered: take what came before

    def send(self, message: ToCore) -> None:
        """A dead core takes nothing (a PUSH with no peer would block the event loop)."""
        if self._push.closed or not self._process.is_alive():
            return
        try:
            self._push.send(self._encoder.encode(message))
        except zmq.Again:
            logger.error("the engine core took no message for %d ms; dropped a %s",
                         SEND_TIMEOUT_MS, type(message).__name__)

    def is_alive(self) -> bool:
        return self._process.is_alive()

    async def stop(self, timeout: float) -> None:
        self._stopping = True
        await stop_core(self, self._process.join, timeout)
        if self._process.is_alive():
            self._process.kill()
            await asyncio.to_thread(self._process.join, 5)
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._process.sentinel)
        loop.remove_reader(self._pull.getsockopt(zmq.FD))
        self._cleanup()

    def _read_all(self, deliver: Callable[[FromCore], None]) -> None:
        """Deliver every message that has arrived, in one go: when the event loop falls
        behind the core, its streams then catch up several steps per chunk, rather than
        waking once per step."""
        while self._pull.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            deliver(self._decoder.decode(self._pull.recv(zmq.NOBLOCK)))

    def _on_exit(self, deliver: Callable[[FromCore], None]) -> None:
        asyncio.get_running_loop().remove_reader(self._process.sentinel)
        if not self._stopping:
            deliver(CoreFailed(f"the engine core process exited unexpectedly (exit code "
                               f"{self._process.exitcode})"))

    def _cleanup(self) -> None:
        self._push.close(linger=0)
        self._pull.close(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)


# ---- the child process ----

def _core_main(config: EngineConfig, to_core: str, from_core: str, report: Connection,
               parent_pid: int, log_level: int) -> None:
    _die_with_parent()
    logging.basicConfig(level=log_level, format=LOG_FORMAT)  # a spawned process starts bare
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from engine.core.engine_core import EngineCore, run_core_loop  # torch: in the child only

    try:
        core = EngineCore(config)
    except Exception as exc:
        report.send(("error", str(exc) or type(exc).__name__))
        raise SystemExit(1) from None
    context = zmq.Context()
    pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    pull.setsockopt(zmq.RCVHWM, 0)
    push.setsockopt(zmq.SNDHWM, 0)
    pull.connect(to_core)
    push.connect(from_core)
    runner = core.runner
    report.send(("ready", dict(
        device=str(runner.device), dtype=str(runner.dtype).removeprefix("torch."),
        attention_backend=runner.attention_backend, num_kv_blocks=runner.num_kv_blocks,
        pool_tokens=core.block_manager.num_tokens, startup_phases=runner.startup.summary())))
    report.close()
    tune_gc()
    decoder, encoder = msgspec.msgpack.Decoder(ToCore), msgspec.msgpack.Encoder()

    def receive(block: bool) -> list[ToCore]:
        while block and not pull.poll(PARENT_CHECK_MS):
            if os.getppid() != parent_pid:
                raise SystemExit("the server process is gone")
        messages = []
        while pull.poll(0):
            messages.append(decoder.decode(pull.recv()))
        return messages

    run_core_loop(core, receive, lambda message: push.send(encoder.encode(message)))
    push.close(linger=1000)  # let the last StepOutput or CoreFailed go out
    pull.close(linger=0)


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (elsewhere: the idle loop's
    parent check is the only guard)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
