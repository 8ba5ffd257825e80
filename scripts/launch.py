"""Start `python -m server` for a benchmark or a soak, and stop it: shared by bench_serve.py
and soak.py (tests start theirs with tests/server_harness.py). From the command line, runs a
command pinned to CPUs as bench_serve.py pins the server and its load generator:

    python scripts/launch.py --cpus 6-15 -- gpt2-bench --base-url http://127.0.0.1:8000
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def launch_server(flags: list[str], log_path: Path, timeout: float = 300.0,
                  cpus: set[int] | None = None) -> tuple[subprocess.Popen, str]:
    """`python -m server FLAGS` on a free local port, logging to log_path, its processes on
    `cpus` (None: any); returns once /health answers 200, or exits naming the log."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "server", "--host", "127.0.0.1", "--port", str(port),
               *flags]
    with open(log_path, "w") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=pin_to(cpus))
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    sys.exit(f"the server did not come up; see {log_path}")


def pin_to(cpus: set[int] | None):
    """A Popen preexec_fn that keeps the child, and every process it starts, on `cpus`."""
    return None if cpus is None else lambda: os.sched_setaffinity(0, cpus)


def parse_cpus(text: str) -> set[int]:
    """taskset's list syntax: "8-15" or "0,2,4-7"."""
    cpus = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def tree_cpu_seconds(root: int) -> dict[int, float]:
    """CPU seconds (user + system) of root and every process under it, by pid, from /proc:
    read before and after a run, it shows which of the server's processes was busy."""
    tick = os.sysconf("SC_CLK_TCK")
    stats = {}
    for pid in (int(entry) for entry in os.listdir("/proc") if entry.isdigit()):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):  # it exited meanwhile
            continue
        # the fields after the name: state, ppid, ..., utime (the 12th), stime (the 13th)
        stats[pid] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    tree, frontier = {}, [root] if root in stats else []
    while frontier:
        pid = frontier.pop()
        tree[pid] = stats[pid][1]
        frontier += children.get(pid, [])
    return tree


def stop_server(proc: subprocess.Popen) -> dict[str, float | int]:
    """SIGTERM, and how long the server took to exit (killed after 120 s)."""
    proc.terminate()
    start = time.monotonic()
    try:
        code = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    return {"exit_code": code, "seconds_to_exit": time.monotonic() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description="Run a command pinned to CPUs.")
    parser.add_argument("--cpus", type=parse_cpus,
                        help='taskset\'s list syntax, e.g. "8-15" or "0,2,4-7" (default: any)')
    parser.add_argument("command", nargs="+", help="the command, after --")
    args = parser.parse_args()
    sys.exit(subprocess.run(args.command, check=False, preexec_fn=pin_to(args.cpus)).returncode)


if __name__ == "__main__":
    main()
