"""Load-test a running server; the same as the `gpt2-bench` console script (server/bench/).

    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --request-rate 20
"""
from server.bench.cli import main

if __name__ == "__main__":
    main()
