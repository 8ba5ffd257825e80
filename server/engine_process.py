"""The engine core in a process of its own, so that its ~1 ms step loop never waits for the
HTTP side's per-token Python work (detokenizing, SSE, JSON) and vice versa.

    API server i (uvicorn, AsyncEngine, CoreClient)      engine-core process (run_core_loop)
      PUSH ──AddSequences, AbortSequences, Shutdown──▶ PULL, bound at ipc://…/to_core
      PULL, bound at ipc://…/from_core_i ◀──StepOutput (one per step), CoreFailed── PUSH i
      startup: the core reports "ready" (or why not) over a pipe to its parent

One API server (the default) is the core's parent; with `--api-server-count N` the parent is
`gpt2-serve`'s supervisor (server/api_servers.py) and each of the N servers has its own
from_core socket. Every PUSH connects and every PULL binds, so a message sent before its
receiver is up waits in the sender's queue and a send never blocks.

Messages are msgspec Structs encoded as msgpack (engine/core/messages.py). The core process
dies with its parent: the kernel kills it when its parent dies (PR_SET_PDEATHSIG), and its idle
loop checks its parent each time it waits in vain. It ignores SIGINT: a Ctrl-C reaches the whole process group, and
the server's shutdown (drain, then Shutdown) decides when the core stops. On CPU it sets
torch's thread count itself (`set_cpu_threads`).
"""
from __future__ import annotations

import ctypes
import gc
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

import msgspec
import zmq

from engine.core.config import EngineConfig
from engine.core.messages import FromCore, Shutdown, ToCore
from server.client_router import ClientRouter

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # every process logs alike
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
    """What an API server needs to know of a ready core: its sockets, its process, and what
    it resolved at startup ("auto" settings) for the log and the admission checks."""
    to_core: str
    from_core: tuple[str, ...]  # one per API server
    pid: int
    max_model_len: int
    device: str
    dtype: str
    attention_backend: str
    num_kv_blocks: int
    pool_tokens: int
    startup_phases: str  # "process start 2.1 s, load 1.2 s, skinny table 0.1 s (cached), ..."


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
            target=_core_main, name="engine-core", daemon=True,
            args=(config, to_core, from_core, child_report, os.getpid(),
                  logging.getLogger().level, time.time()))
        self._process.start()
        child_report.close()
        resolved = self._wait_ready(report)
        self.info = CoreInfo(to_core, from_core, self._process.pid,
                             config.scheduler.max_model_len, **resolved)

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


# ---- the child process ----

def _core_main(config: EngineConfig, to_core: str, from_core: tuple[str, ...],
               report: Connection, parent_pid: int, log_level: int, spawned_at: float) -> None:
    die_with_parent()
    logging.basicConfig(level=log_level, format=LOG_FORMAT)  # a spawned process starts bare
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from engine.build import build_engine_core
    from engine.core.engine_core import run_core_loop
    # torch and triton load in the child only, and count in its "process start"
    import engine.worker.model_runner  # noqa: F401
    started = f"process start {time.time() - spawned_at:.1f} s"

    try:
        core = build_engine_core(config)
    except Exception as exc:
        report.send(("error", str(exc) or type(exc).__name__))
        raise SystemExit(1) from None
    if str(core.runner.device) == "cpu":
        logger.info("engine core on CPU: %d torch threads",
                    set_cpu_threads(config.model.num_cpu_threads))
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)
    pull.bind(to_core)  # before "ready": an API server may send the moment it hears that
    pushes = []
    for address in from_core:
        push = context.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 0)  # queue until the API server is up, never drop
        push.connect(address)
        pushes.append(push)
    runner = core.runner
    report.send(("ready", dict(
        device=str(runner.device), dtype=str(runner.dtype).removeprefix("torch."),
        attention_backend=runner.attention_backend, num_kv_blocks=runner.num_kv_blocks,
        pool_tokens=core.block_manager.num_tokens,
        startup_phases=", ".join(filter(None, (started, runner.startup.summary()))))))
    report.close()
    tune_gc()
    decoder, encoder = msgspec.msgpack.Decoder(ToCore), msgspec.msgpack.Encoder()
    router = ClientRouter(len(pushes))

    def receive(timeout: float) -> list[ToCore]:
        if timeout and not pull.poll(int(timeout * 1000)) and os.getppid() != parent_pid:
            raise SystemExit("the server process is gone")
        frames = []
        while pull.poll(0):
            frames.append(pull.recv())
        return decode_frames(frames, decoder, router)

    def send(message: FromCore) -> None:
        for client, routed in router.route(message):
            pushes[client].send(encoder.encode(routed))

    run_core_loop(core, receive, send)
    for push in pushes:
        push.close(linger=1000)  # let the last StepOutput or CoreFailed go out
    pull.close(linger=0)


def set_cpu_threads(configured: int | None) -> int:
    """Set torch's intra-op threads for a core on CPU and return the count: `configured`
    (--num-cpu-threads), else one per core this process may run on (os.sched_getaffinity:
    taskset and cpusets count, os.cpu_count() would not) but one, which the API server
    streaming the tokens needs. Threads beyond the free cores make every op's barrier wait
    for a descheduled thread: with a busy neighbour on 2 cores, 2 threads took 3x as long per
    token as 1 (README, "On a CPU")."""
    import torch

    threads = configured or max(1, len(os.sched_getaffinity(0)) - 1)
    torch.set_num_threads(threads)
    return threads


def decode_frames(frames: list[bytes], decoder: msgspec.msgpack.Decoder,
                  router: ClientRouter) -> list[ToCore]:
    """The messages in these frames, each noted by the router. A frame that is not a valid
    message is logged and dropped: it must not kill the core (only a process of the server's
    own user can reach the socket, whose directory is 0700)."""
    messages = []
    for frame in frames:
        try:
            message = decoder.decode(frame)
            router.note(message)
        except (msgspec.DecodeError, ValueError) as exc:
            logger.warning("dropped a malformed message to the engine core (%d bytes): %s",
                           len(frame), exc)
            continue
        messages.append(message)
    return messages


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (elsewhere: the idle loop's
    parent check is the only guard)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
