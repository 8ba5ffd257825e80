"""OpenAI-compatible HTTP server for the gpt2-serve engine (`gpt2-serve`, `python -m server`).

    __main__.py        flags, then bind, start the engine core process, serve
    app.py             routes, error shapes, API key, lifespan
    completions.py     /v1/completions: JSON and SSE responses
    chat.py            /v1/chat/completions (chat_template.py renders the messages)
    protocol.py        request/response models and every input check
    engine_client.py   the API server's client of the engine core: output processing,
                       admission, the watchdog
    core_client.py     its sockets to the engine-core process
    engine_process.py  the parent's handle on that process; core_main.py is its main
    api_servers.py     --api-server-count N: N API servers in front of one core
    http_server.py     uvicorn under per-connection limits
    metrics.py         Prometheus metrics under vLLM's names
    bench/             gpt2-bench, the load generator
"""
