"""The engine core's torch threads on CPU: from the CPUs it may keep busy (its affinity, or a
container's CPU quota if lower), less the API server's, or --num-cpu-threads. Run in a
subprocess: the count is process-wide."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.core.cpus import usable_cpus
from server_harness import ROOT

PROBE = """
import os, sys, torch
import server.core_main as core_main
os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:int(sys.argv[1])]))
configured = None if sys.argv[2] == "-" else int(sys.argv[2])
if sys.argv[3] != "-":  # a CPU quota, as usable_cpus would read it
    core_main.usable_cpus = lambda: float(sys.argv[3])
print(core_main.set_cpu_threads(configured), torch.get_num_threads())
"""


def threads(cores: int, configured: int | None, quota: float | None = None) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, str(cores), str(configured or "-"),
                          str(quota or "-")],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    returned, actual = map(int, out.split())
    return returned, actual


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
@pytest.mark.parametrize("cores, configured, expected", [
    (2, None, 1), (1, None, 1), (2, 3, 3), (1, 2, 2)])
def test_thread_count_follows_affinity_or_the_flag(cores, configured, expected):
    assert threads(cores, configured) == (expected, expected)


def test_thread_count_follows_the_usable_cpus():
    """What usable_cpus says, not the affinity alone: here 3 CPUs (one for the API server)."""
    assert threads(1, None, quota=3.0) == (2, 2)


@pytest.mark.parametrize("files,expected", [
    ({}, None),  # no cgroup files: the affinity
    ({"cpu.max": "max 100000"}, None),
    ({"cpu.max": "150000 100000"}, 1.5),  # docker run --cpus=1.5, cgroup v2
    ({"cpu/cpu.cfs_quota_us": "200000", "cpu/cpu.cfs_period_us": "100000"}, 2.0),  # v1
    ({"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, None),
    ({"cpu.max": "garbled"}, None)])
def test_usable_cpus_are_the_affinity_within_a_cgroup_quota(tmp_path, files, expected):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    affinity = len(os.sched_getaffinity(0))
    assert usable_cpus(tmp_path) == (affinity if expected is None else min(affinity, expected))
