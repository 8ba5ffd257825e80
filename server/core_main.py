"""The engine-core process's main (server/engine_process.py starts it): build the engine,
report "ready" (or why not) to the parent, then run the core's loop between the sockets.

It dies with its parent: the kernel kills it when its parent dies (PR_SET_PDEATHSIG), and its
idle loop checks its parent each time it waits in vain. It ignores SIGINT: a Ctrl-C reaches
the whole process group, and the server's shutdown (drain, then Shutdown) decides when the
core stops. On CPU it sets torch's thread count itself (`set_cpu_threads`).
"""
from __future__ import annotations

import logging
import os
import signal
import time
from multiprocessing.connection import Connection

import msgspec
import zmq

from engine.core.config import EngineConfig
from engine.core.messages import FromCore, ToCore
from engine.core.cpus import usable_cpus
from server.client_router import ClientRouter
from server.processes import LOG_FORMAT, die_with_parent, tune_gc

logger = logging.getLogger("gpt2serve.engine")


def core_main(config: EngineConfig, to_core: str, from_core: tuple[str, ...],
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
    (--num-cpu-threads), else one per CPU this process may keep busy (usable_cpus: taskset,
    cpusets and a container's CPU quota count) but one, which the API server streaming the
    tokens needs. Threads beyond the free cores make every op's barrier wait for a
    descheduled thread."""
    import torch

    threads = configured or max(1, int(usable_cpus()) - 1)
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
