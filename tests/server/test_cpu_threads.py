"""The engine core's torch threads on CPU: from the cores it may run on, less the API
server's, or --num-cpu-threads. Run in a subprocess: the count is process-wide."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from server_harness import ROOT

PROBE = """
import os, sys, torch
from server.core_main import set_cpu_threads
os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:int(sys.argv[1])]))
configured = None if sys.argv[2] == "-" else int(sys.argv[2])
print(set_cpu_threads(configured), torch.get_num_threads())
"""


def threads(cores: int, configured: int | None) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, str(cores), str(configured or "-")],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    returned, actual = map(int, out.split())
    return returned, actual


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
@pytest.mark.parametrize("cores, configured, expected", [
    (2, None, 1), (1, None, 1), (2, 3, 3), (1, 2, 2)])
def test_thread_count_follows_affinity_or_the_flag(cores, configured, expected):
    assert threads(cores, configured) == (expected, expected)
