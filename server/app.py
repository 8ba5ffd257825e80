"""The FastAPI app: routes, error shapes, API-key check, and the engine's lifetime.

Bodies are read and parsed by hand (`read_json_body`) instead of through FastAPI's
parameter injection: that is what lets every bad input (malformed JSON, an oversized body, a
wrong type) answer 400 in OpenAI's error shape instead of FastAPI's 422.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import RootModel
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send
from swagger_ui_bundle import swagger_ui_path

from engine.output.tokenizer import Tokenizer
from server.engine_client import (EngineClient, CoreConnection, RequestFailed, server_error,
                                 shutting_down)
from server.chat import ChatCompletionRequest, ChatService, TokenizeChatRequest
from server.completions import SERVER_SEND, CompletionService, off_loop_if_long
from server.metrics import ServerMetrics, ThroughputLog
from server.protocol import (CompletionRequest, DetokenizeRequest, Limits, RequestError,
                             TokenizeRequest, check_tokens_in_vocab, parse_model,
                             request_body_schema)

logger = logging.getLogger("gpt2serve")
ENGINE_STOP_TIMEOUT = 1.0  # seconds the lifespan waits for the engine loop to exit
DOCS_ASSETS = "/docs/assets"  # Swagger UI's JS, CSS and icon (the swagger-ui-bundle package)


@dataclass(frozen=True)
class ServerSettings:
    model_name: str
    max_queued_requests: int = 20_000  # sequences (prompts x n) waiting before 503
    max_n: int = 16
    max_prompts_per_request: int = 2048
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    log_interval: float = 10.0  # seconds between throughput lines; 0 turns them off
    watchdog_timeout: float = 60.0  # the core silent this long: requests fail, /health 503
    watchdog_exit_timeout: float | None = None  # silent this long: exit (None: 2x the above)
    shutdown_timeout: float = 30.0  # after SIGTERM, open streams end with an error after this
    enable_docs: bool = True  # /openapi.json and /docs
    # the engine's: "priority" lets requests set `priority` (SchedulerConfig.scheduling_policy)
    scheduling_policy: str = "fcfs"
    cache_config_info: dict[str, str] | None = None  # labels (metrics.cache_config_labels)
    chat_template: str | None = None  # its text (--chat-template, or the checkpoint's)
    trust_request_chat_template: bool = False  # a request's own chat_template is rendered
    # CORS, with vLLM's defaults (--allowed-origins, ...)
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


def version() -> str:
    try:
        return metadata.version("gpt2-serve")
    except metadata.PackageNotFoundError:
        return "0.0.0+unknown"


def create_app(core: CoreConnection, settings: ServerSettings) -> FastAPI:
    """Serve a started engine core (a process, or a thread in tests); the app's lifespan
    connects to it, and stops it at the end."""
    tokenizer = Tokenizer()
    metrics = ServerMetrics(settings.model_name, core.max_model_len,
                            counts_engine_totals=core.client_index == 0,
                            cache_config_info=settings.cache_config_info)
    engine_client = EngineClient(core, tokenizer, settings.max_queued_requests,
                               settings.watchdog_timeout, settings.watchdog_exit_timeout,
                               observe_output=metrics.observe_output,
                               observe_stats=metrics.observe_stats,
                               observe_request=metrics.observe_request,
                               flush_observations=metrics.flush)
    limits = Limits(tokenizer.vocab_size, core.max_model_len, settings.max_n,
                    settings.max_prompts_per_request,
                    priority_scheduling=settings.scheduling_policy == "priority")
    service = CompletionService(engine_client, tokenizer, settings.model_name, limits)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine_client.start()
        log_task = asyncio.create_task(_log_throughput(ThroughputLog(metrics), engine_client,
                                                       settings.log_interval))
        try:
            yield
        finally:
            log_task.cancel()
            await engine_client.stop(timeout=ENGINE_STOP_TIMEOUT)

    docs = settings.enable_docs
    app = _App(title="gpt2-serve", version=version(), lifespan=lifespan,
               openapi_url="/openapi.json" if docs else None, docs_url=None, redoc_url=None)
    app.state.engine_client, app.state.metrics = engine_client, metrics
    app.state.begin_shutdown = functools.partial(_begin_shutdown, engine_client,
                                                  settings.shutdown_timeout)
    engine_client.on_fatal = functools.partial(_exit_server, app)
    _add_error_handlers(app)
    _add_routes(app, service, metrics, settings)
    if docs:
        _add_docs(app)
    app.add_middleware(CORSMiddleware, allow_origins=settings.allowed_origins,
                       allow_methods=settings.allowed_methods,
                       allow_headers=settings.allowed_headers,
                       allow_credentials=settings.allow_credentials)
    if settings.api_key:  # outside CORS: its 401s are plain, preflights pass through
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    return app


class _App(FastAPI):
    """FastAPI keeping the server's own `send` in each request's scope (SERVER_SEND), so that
    an event stream's body skips the middlewares' wrappers (SSEResponse)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[SERVER_SEND] = send
        await super().__call__(scope, receive, send)


def _add_docs(app: FastAPI) -> None:
    """/docs: FastAPI's Swagger UI page, its assets served from DOCS_ASSETS instead of a CDN,
    so it works offline. Like /docs itself, they are behind --api-key."""
    app.mount(DOCS_ASSETS, StaticFiles(directory=swagger_ui_path), name="swagger-ui")

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=app.openapi_url, title=f"{app.title} - Swagger UI",
                                   swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{DOCS_ASSETS}/favicon-32x32.png")


def _begin_shutdown(engine_client: EngineClient, timeout: float) -> None:
    """SIGTERM arrived (on the event loop): in-flight requests get `timeout` seconds, then
    whatever is still open ends with a 503 error (an SSE error event and [DONE])."""
    logger.info("shutting down: open requests get %.1f s to finish", timeout)
    asyncio.get_running_loop().call_later(timeout, engine_client.fail_open, shutting_down)


def _exit_server(app: FastAPI) -> None:
    """The core is lost: stop serving and exit non-zero (server/http_server.py sets
    `stop_server`; an app served some other way, as in tests, keeps running)."""
    stop_server = getattr(app.state, "stop_server", None)
    if stop_server is not None:
        stop_server(1)


async def _log_throughput(log: ThroughputLog, engine_client: EngineClient,
                          interval: float) -> None:
    while interval > 0:
        await asyncio.sleep(interval)
        if engine_client.stats is not None:
            logger.info(log.line(engine_client.stats, engine_client.num_waiting,
                                 engine_client.silence()))


def _add_routes(app: FastAPI, service: CompletionService, metrics: ServerMetrics,
                settings: ServerSettings) -> None:
    tokenizer, limits = service.tokenizer, service.limits
    engine_client = service.engine
    chat = ChatService(service, settings.chat_template, settings.trust_request_chat_template)

    @app.post("/v1/completions", openapi_extra=request_body_schema(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await service.create(request, await read_json_body(request, settings))

    @app.post("/v1/chat/completions", openapi_extra=request_body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await chat.create(request, await read_json_body(request, settings))

    @app.post("/invocations", openapi_extra=request_body_schema(
        RootModel[CompletionRequest | ChatCompletionRequest]))
    async def invocations(request: Request) -> Response:
        """SageMaker's one route: a body with `messages` is a chat request, else a
        completions one."""
        body = await read_json_body(request, settings)
        if isinstance(body, dict) and "messages" in body:
            return await chat.create(request, body)
        return await service.create(request, body)

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": settings.model_name, "object": "model", "created": int(time.time()),
            "owned_by": "gpt2-serve", "root": settings.model_name, "parent": None,
            "max_model_len": limits.max_model_len}]}

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        return Response(status_code=200 if engine_client.healthy else 503)

    @app.api_route("/ping", methods=["GET", "POST"], include_in_schema=False)  # SageMaker's
    async def ping() -> Response:
        return await health()

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/version", methods=["GET", "HEAD"])
    async def get_version() -> dict[str, str]:
        return {"version": version()}

    @app.post("/tokenize", openapi_extra=request_body_schema(
        RootModel[TokenizeRequest | TokenizeChatRequest]))
    async def tokenize(request: Request) -> Response:
        """A `prompt`'s tokens, or with `messages` instead the chat prompt's, as vLLM's.
        Encoded by msgspec: FastAPI's encoder walks a list element by element, ~180 ms of
        the event loop for a 1 MiB prompt's tokens, where msgspec takes ~2."""
        body = await read_json_body(request, settings)
        if isinstance(body, dict) and "messages" in body:
            tokens = await chat.tokenize(body)
        else:
            req = parse_model(TokenizeRequest, body)
            service.check_model(req.model)
            tokens = (await service.encode_prompts([req.prompt]))[0]
        return Response(msgspec.json.encode({"count": len(tokens), "max_model_len":
                                             limits.max_model_len, "tokens": tokens}),
                        media_type="application/json")

    @app.post("/detokenize", openapi_extra=request_body_schema(DetokenizeRequest))
    async def detokenize(request: Request) -> dict[str, Any]:
        req = parse_model(DetokenizeRequest, await read_json_body(request, settings))
        service.check_model(req.model)
        check_tokens_in_vocab(req.tokens, limits.vocab_size, param="tokens")
        return {"prompt": await off_loop_if_long(len(req.tokens), tokenizer.decode,
                                                 req.tokens)}


async def read_json_body(request: Request, settings: ServerSettings) -> Any:
    """The body as JSON. Refused: past the size cap (413, without reading it all), not
    JSON-typed, not UTF-8, or holding a lone surrogate (400): nothing the engine cannot
    encode gets past here."""
    _check_content_type(request)
    limit = settings.max_body_bytes
    too_big = RequestError(f"the request body is larger than {limit} bytes "
                           "(--max-request-body-bytes)", code="body_too_large", status=413)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_big
    except ClientDisconnect:  # nobody reads the answer: no traceback, no work
        raise RequestError("the client disconnected", code="client_disconnected",
                           status=499) from None
    try:  # msgspec: several times the stdlib's speed on a long prompt
        return msgspec.json.decode(body)
    except UnicodeDecodeError as exc:
        raise RequestError(f"the request body is not valid UTF-8: {exc.reason} at byte "
                           f"{exc.start}", code="invalid_json") from None
    except (msgspec.DecodeError, RecursionError):
        pass  # the stdlib also takes NaN, 1e400 and escaped lone surrogates: checked below
    try:
        parsed = json.loads(body.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise RequestError(f"malformed JSON body: {exc}", code="invalid_json") from None
    where = lone_surrogate_at(parsed)
    if where is not None:
        raise RequestError(f"{where or 'the body'} holds a lone UTF-16 surrogate (an unpaired "
                           "\\ud800-\\udfff escape), which is not text", param=where or None)
    return parsed


def _check_content_type(request: Request) -> None:
    """As vLLM: a body sent as something other than JSON is refused, not guessed at."""
    kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if kind and kind != "application/json" and not kind.endswith("+json"):
        raise RequestError(f"unsupported content type {kind!r}: send application/json",
                           code="unsupported_media_type", status=415)


def lone_surrogate_at(value: Any, path: str = "") -> str | None:
    """The path ("stop[0]") of the first string, or key, holding a lone surrogate; None if
    there is none. Such a string cannot be encoded as UTF-8, so it must not reach the core."""
    if isinstance(value, str):
        return path if _SURROGATE.search(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            # the key's own surrogates escaped: the path goes into the error's JSON
            where = path + ("." if path else "") + key.encode("utf-8", "backslashreplace"
                                                              ).decode()
            if _SURROGATE.search(key):
                return where
            found = lone_surrogate_at(item, where)
            if found is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = lone_surrogate_at(item, f"{path}[{index}]")
            if found is not None:
                return found
    return None


_SURROGATE = re.compile("[\ud800-\udfff]")


def _error_response(err: RequestError) -> JSONResponse:
    headers = {"Retry-After": "1"} if err.status == 503 else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def on_request_error(_: Request, err: RequestError) -> JSONResponse:
        return _error_response(err)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {"loc": (), "msg": "invalid request"}
        param = next((str(p) for p in first["loc"] if p != "body"), None)
        return _error_response(RequestError(f"{param}: {first['msg']}", param=param))

    @app.exception_handler(HTTPException)
    async def on_http_error(_: Request, err: HTTPException) -> JSONResponse:
        """Starlette's own errors (404, 405 with its Allow header) in OpenAI's shape."""
        response = _error_response(RequestError(str(err.detail), code=str(err.status_code),
                                                status=err.status_code))
        response.headers.update(err.headers or {})
        return response

    @app.exception_handler(RequestFailed)
    async def on_request_failed(_: Request, err: RequestFailed) -> JSONResponse:
        return _error_response(err.error)

    @app.exception_handler(Exception)
    async def on_internal_error(_: Request, err: Exception) -> JSONResponse:
        """Starlette re-raises unexpected errors after this, so uvicorn logs the traceback."""
        return _error_response(server_error("internal server error", "internal_error"))


OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})  # probes and scrapers


class ApiKeyMiddleware:
    """Bearer-token check on every route but OPEN_PATHS. The path tested is the decoded one
    the router matches, and only an exact match is open: no spelling of another route (a
    percent-encoding, a trailing slash, a dot segment) escapes the check. OPTIONS passes: a
    CORS preflight carries no credentials, and it runs nothing."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope.get("path") not in OPEN_PATHS
                and scope.get("method") != "OPTIONS" and not self._authorized(scope)):
            response = JSONResponse(RequestError("invalid or missing API key", code="401",
                                                 status=401).body(), status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        given = dict(scope.get("headers", [])).get(b"authorization", b"")
        return secrets.compare_digest(given, self.expected)
