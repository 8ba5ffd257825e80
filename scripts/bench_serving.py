"""Load-test a running server; the same as the `gpt2-bench` console script (server/bench/).

    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --request-rate 20
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from server.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
