"""`gpt2-bench` (also `scripts/bench_serving.py`): load-test an OpenAI-compatible completions
server in the style of `vllm bench serve`, from one or several client processes.

    workload.py  prompts (random, shared-prefix, JSONL file) and Poisson arrival times
    client.py    streaming requests, one asyncio loop per worker process, merged results
    metrics.py   TTFT / TPOT / ITL / E2EL from each request's event times; the report
    plots.py     latency CDFs and the rate-sweep plot (matplotlib, the `bench` extra)
    cli.py       the command line
"""
