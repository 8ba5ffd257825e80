"""How many CPUs this process may keep busy, for sizing its threads and child processes."""
from __future__ import annotations

import os
from pathlib import Path


def usable_cpus(cgroup: Path = Path("/sys/fs/cgroup")) -> float:
    """CPUs this process may keep busy: those it may run on (taskset, cpusets), fewer where a
    cgroup's CPU quota says so (`docker run --cpus`: v2's cpu.max, v1's cpu.cfs_quota_us)."""
    cpus: float = len(os.sched_getaffinity(0))
    for quota_file, period_file in (("cpu.max", None),
                                    ("cpu/cpu.cfs_quota_us", "cpu/cpu.cfs_period_us")):
        try:
            quota, *rest = (cgroup / quota_file).read_text().split()
            period = rest[0] if period_file is None else (cgroup / period_file).read_text()
            if quota not in ("max", "-1"):
                cpus = min(cpus, int(quota) / int(period))
        except (OSError, ValueError, IndexError):
            continue
    return cpus
