"""Stress tests: each module starts its own `python -m server` subprocess(es) on the tiny
checkpoint with the flags its property needs, through `launch`, and stops them at the end.

The servers run torch with one CPU thread (ONE_THREAD): on a loaded 2-core machine the engine
core's intra-op threads, the API process and the test client oversubscribe the cores, and a
tiny model's step then took 400 ms instead of 2.5 ms now and then (runs varied 10x)."""
from __future__ import annotations

import pytest

from server_harness import ServerProcess

ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def launch(tiny_checkpoint, tmp_path_factory):
    started: list[ServerProcess] = []

    def start(*flags: str, module: str = "server",
              rlimit_nofile: int | None = None) -> ServerProcess:
        log = tmp_path_factory.mktemp("srv") / "server.log"
        with pytest.MonkeyPatch.context() as patch:  # the server copies the environment
            for name, value in ONE_THREAD.items():
                patch.setenv(name, value)
            started.append(ServerProcess(tiny_checkpoint, log, *flags, module=module,
                                         rlimit_nofile=rlimit_nofile))
        return started[-1]

    yield start
    for proc in started:
        proc.stop()
