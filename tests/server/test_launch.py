"""scripts/launch.py's CPU pinning, which bench_serve.py's --client-cpus uses to keep the load
generator off the server's CPUs, through its command line."""
import os
import subprocess
import sys

import pytest
from server_harness import ROOT

# prints its CPUs, then its child's
REPORT = ("import os, subprocess, sys; print(sorted(os.sched_getaffinity(0))); "
          "subprocess.run([sys.executable, '-c', "
          "'import os; print(sorted(os.sched_getaffinity(0)))'])")


def run_pinned(*cpus: str) -> list[str]:
    """`python scripts/launch.py [--cpus CPUS] -- python -c REPORT`: the two CPU lists."""
    done = subprocess.run([sys.executable, "scripts/launch.py", *cpus, "--",
                           sys.executable, "-c", REPORT], cwd=ROOT, capture_output=True,
                          text=True, check=True, timeout=60)
    return done.stdout.splitlines()


def test_pinned_command_and_its_children_stay_on_the_cpus():
    cpu = max(os.sched_getaffinity(0))
    assert run_pinned("--cpus", str(cpu)) == [f"[{cpu}]"] * 2


def test_cpus_read_tasksets_list_syntax():
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2 or cpus != list(range(cpus[0], cpus[-1] + 1)):
        pytest.skip("needs two or more contiguous CPUs")
    for text in (f"{cpus[0]}-{cpus[-1]}", f"{cpus[0]},{cpus[1]}-{cpus[-1]}",
                 ",".join(map(str, cpus))):
        assert run_pinned("--cpus", text) == [str(cpus)] * 2


def test_no_cpus_means_no_pinning():
    assert run_pinned() == [str(sorted(os.sched_getaffinity(0)))] * 2


def test_a_bad_cpu_list_is_a_usage_error():
    done = subprocess.run([sys.executable, "scripts/launch.py", "--cpus", "two", "--", "true"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "--cpus" in done.stderr
