"""scripts/launch.py's CPU pinning, which bench_serve.py's --client-cpus uses to keep the load
generator off the server's CPUs."""
import os
import subprocess
import sys

from launch import parse_cpus, pin_to


def test_parse_cpus_reads_taskset_lists():
    assert parse_cpus("8-11") == {8, 9, 10, 11}
    assert parse_cpus("0,2,4-5") == {0, 2, 4, 5}
    assert parse_cpus("3") == {3}


def test_pinned_child_and_its_children_stay_on_the_cpus():
    cpu = min(os.sched_getaffinity(0))
    code = ("import os, subprocess, sys; print(sorted(os.sched_getaffinity(0))); "
            "subprocess.run([sys.executable, '-c', "
            "'import os; print(sorted(os.sched_getaffinity(0)))'])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          preexec_fn=pin_to({cpu}), check=True)
    assert done.stdout.split() == [f"[{cpu}]"] * 2


def test_no_cpus_means_no_pinning():
    assert pin_to(None) is None
