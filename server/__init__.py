"""OpenAI-compatible HTTP server for the gpt2-serve engine (`gpt2-serve`, `python -m server`).

    app.py           routes, error shapes, API key, lifespan
    completions.py   /v1/completions: JSON and SSE responses
    async_engine.py  the engine's thread and its bridge to asyncio
    protocol.py      request/response models and every input check
    metrics.py       Prometheus metrics under vLLM's names
"""
