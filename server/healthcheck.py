"""The container's HEALTHCHECK: GET /health on the host and port the server was started with.

    python -m server.healthcheck [PID]

It reads the server's own command line from /proc (PID, else the first gpt2-serve process), so
`docker run IMAGE --port 9000` needs no matching change to the image. Exit 0: ready; 1: not.
"""
from __future__ import annotations

import argparse
import sys
import urllib.request
from pathlib import Path

DEFAULT_PORT = 8000  # gpt2-serve's --port default (a test keeps the two equal)
ANY_ADDRESS = ("", "0.0.0.0", "::")


def is_server(argv: list[str]) -> bool:
    """`gpt2-serve ...`, `python .../gpt2-serve ...` or `python -m server ...`."""
    return (any(Path(arg).name == "gpt2-serve" for arg in argv[:2])
            or argv[1:3] == ["-m", "server"])


def read_cmdline(pid: str) -> list[str]:
    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    return raw.decode(errors="replace").split("\0")[:-1]


def find_server() -> list[str]:
    pids = sorted((p.name for p in Path("/proc").iterdir() if p.name.isdigit()), key=int)
    for pid in pids:
        try:
            argv = read_cmdline(pid)
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if is_server(argv):
            return argv
    raise SystemExit("healthcheck: no gpt2-serve process found")


def health_url(argv: list[str]) -> str:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--host", default="")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    args, _ = parser.parse_known_args(argv)
    host = "127.0.0.1" if args.host in ANY_ADDRESS else args.host
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{args.port}/health"


def main() -> None:
    argv = read_cmdline(sys.argv[1]) if len(sys.argv) > 1 else find_server()
    url = health_url(argv)
    try:
        with urllib.request.urlopen(url, timeout=4) as response:
            ok = response.status == 200
    except OSError as exc:  # refused, timed out, or an HTTP error status such as 503
        raise SystemExit(f"healthcheck: {url}: {exc}") from None
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
