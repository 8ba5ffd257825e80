"""Stress tests: each module starts its own `python -m server` subprocess(es) on the tiny
checkpoint with the flags its property needs, through `launch`, and stops them at the end."""
from __future__ import annotations

import pytest

from server_harness import ServerProcess


@pytest.fixture(scope="module")
def launch(tiny_checkpoint, tmp_path_factory):
    started: list[ServerProcess] = []

    def start(*flags: str, module: str = "server") -> ServerProcess:
        log = tmp_path_factory.mktemp("srv") / "server.log"
        started.append(ServerProcess(tiny_checkpoint, log, *flags, module=module))
        return started[-1]

    yield start
    for proc in started:
        proc.stop()
