"""`gpt2-serve` / `python -m server`: build the engine, then serve it with uvicorn.

Every engine setting is a flag named after its config field (`--block-size`, `--max-num-seqs`,
`--enable-prefix-caching/--no-enable-prefix-caching`, ...), applied on top of `--config`;
speculative decoding takes vLLM's JSON: `--speculative-config '{"method": "ngram",
"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'`.
SIGTERM stops accepting connections, lets in-flight requests finish for up to
`--shutdown-timeout` seconds, then exits.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from engine.core.config import (ATTENTION_BACKENDS, DEVICES, DTYPES, QUANTIZATION_METHODS,
                                SCHEDULING_POLICIES, CacheConfig, ConfigError, EngineConfig,
                                ModelConfig, SchedulerConfig, flat_field_names, load_config)
from server.app import ServerSettings, create_app, version
from server.api_servers import ApiServerOptions, listening_socket, run_api_servers
from server.chat_template import resolve_chat_template
from server.core_client import CoreClient
from server.engine_process import EngineProcess
from server.processes import LOG_FORMAT
from server.http_server import HttpLimits, add_http_flags, serve_app
from server.metrics import cache_config_labels

logger = logging.getLogger("gpt2serve")
CONFIG_SECTIONS = (ModelConfig, CacheConfig, SchedulerConfig)
PRESET_DIR = Path(__file__).resolve().parents[1] / "configs"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
ENGINE_FLAG_HELP = {
    "model": "HF hub id (gpt2, gpt2-xl, ...) or a local HF directory",
    "dtype": "weights and activations; auto: float16 on cuda, float32 on cpu",
    "device": "auto: cuda when available",
    "attention_backend": "auto: triton on cuda, torch on cpu",
    "enforce_eager": "run every step eagerly (no CUDA graphs)",
    "mixed_step_graphs": "also capture steps with prompt tokens as CUDA graphs",
    "startup_cache": "reuse the skinny-GEMM table and KV sizing measured by an earlier start "
                     "with nothing changed (kept under TRITON_CACHE_DIR/gpt2-serve)",
    "seed": "seed of requests that set none",
    "num_cpu_threads": "torch threads of the engine core on CPU; None: one per CPU the "
                       "server may keep busy (its affinity, or a container's CPU quota if "
                       "lower) but one, the API server's",
    "quantization": "8-bit weights for the blocks' linears, quantized at load with a scale "
                    "per output channel (vLLM's names); the memory saved goes to the KV cache",
    "block_size": "tokens per KV-cache block",
    "num_kv_blocks": "KV-cache blocks (default: sized from free memory)",
    "gpu_memory_utilization": "fraction of GPU memory the engine may use, KV cache included",
    "cpu_kv_cache_bytes": "KV-cache bytes on CPU when --num-kv-blocks is not given",
    "enable_prefix_caching": "share KV blocks between prompts with a common prefix",
    "max_num_seqs": "requests running at once",
    "max_num_batched_tokens": "token budget of one forward pass",
    "max_model_len": "prompt + output tokens of one request (at most 1024)",
    "async_scheduling": "schedule step N+1 while step N runs on the device",
    "scheduling_policy": "fcfs: arrival order; priority: by the requests' `priority` "
                         "(lower first, then arrival), and preempt the worst first",
}
ENGINE_FLAG_CHOICES = {"dtype": DTYPES, "device": DEVICES,
                       "attention_backend": ATTENTION_BACKENDS,
                       "quantization": QUANTIZATION_METHODS,
                       "scheduling_policy": SCHEDULING_POLICIES,
                       "block_size": tuple(2 ** i for i in range(11))}


def _config_fields() -> dict[str, dataclasses.Field[Any]]:
    by_name = {f.name: f for section in CONFIG_SECTIONS for f in dataclasses.fields(section)}
    return {name: by_name[name] for name in flat_field_names()}


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per config field; unset flags stay None so the YAML preset keeps its value."""
    group = parser.add_argument_group("engine (override --config)")
    for name, field in _config_fields().items():
        flag = "--" + name.replace("_", "-")
        default = field.default if field.default is not dataclasses.MISSING else None
        help_text = f"{ENGINE_FLAG_HELP.get(name, name.replace('_', ' '))} (default: {default})"
        kind = str(field.type)
        if kind == "bool":
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                               default=None, help=help_text)
            continue
        parse = int if "int" in kind else float if "float" in kind else str
        group.add_argument(flag, dest=name, type=parse, default=None, help=help_text,
                           choices=ENGINE_FLAG_CHOICES.get(name))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpt2-serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML preset (sections model, cache, scheduler); "
                        "default: configs/<model name>.yaml when the model's last path "
                        "component names one (gpt2, gpt2-xl, ...)")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", help="the name clients send as `model` "
                        "(default: the --model value)")
    parser.add_argument("--max-queued-requests", type=int, default=20_000,
                        help="sequences (prompts x n) waiting for the engine before new "
                        "requests get 503; a request larger than this gets 400. A waiting "
                        "sequence costs its prompt's memory, ~75 KB at 1024 tokens")
    parser.add_argument("--max-n", type=int, default=16, help="cap on `n` per request")
    parser.add_argument("--max-prompts-per-request", type=int, default=2048,
                        help="cap on the prompts of one request (OpenAI's is 2048)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests get to finish after SIGTERM; then "
                        "open streams end with an error event and the process exits")
    parser.add_argument("--watchdog-timeout", type=float, default=60.0,
                        help="when the engine core has not answered for this many seconds "
                        "(it answers every step, and every 0.2 s when idle), open requests "
                        "fail with 503 and /health answers 503")
    parser.add_argument("--watchdog-exit-timeout", type=float,
                        help="when it has not answered for this many seconds, the server "
                        "exits with code 1 to be restarted (default: twice "
                        "--watchdog-timeout); a dead core makes it exit at once")
    parser.add_argument("--max-request-body-bytes", type=int, default=4 << 20,
                        help="larger request bodies get 413 (default: 4 MiB)")
    parser.add_argument("--allowed-origins", type=_json_list, default=["*"],
                        help='CORS: allowed origins, a JSON list (default: ["*"])')
    parser.add_argument("--allowed-methods", type=_json_list, default=["*"],
                        help='CORS: allowed methods, a JSON list (default: ["*"])')
    parser.add_argument("--allowed-headers", type=_json_list, default=["*"],
                        help='CORS: allowed headers, a JSON list (default: ["*"])')
    parser.add_argument("--allow-credentials", action="store_true",
                        help="CORS: allow credentials")
    parser.add_argument("--disable-fastapi-docs", action="store_true",
                        help="do not serve /openapi.json and /docs")
    parser.add_argument("--api-key", help="require `Authorization: Bearer KEY` on every route "
                        "but /health, /ping, /version and /metrics")
    parser.add_argument("--chat-template", help="the Jinja chat template of "
                        "/v1/chat/completions: a file, or the template itself (default: the "
                        "local checkpoint's, from chat_template.jinja or "
                        "tokenizer_config.json; GPT-2 has none, and chat requests get 400)")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="render the `chat_template` a chat request sends (it runs in "
                        "Jinja's sandbox, but on the server's CPU)")
    parser.add_argument("--api-server-count", type=int, default=1,
                        help="API server processes in front of the one engine core; more "
                        "than one when a single process cannot stream as fast as the engine "
                        "generates (vLLM's flag)")
    parser.add_argument("--log-interval", type=float, default=10.0,
                        help="seconds between throughput log lines (0: off)")
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                        help="debug also prints the traceback of a startup failure")
    parser.add_argument("--speculative-config", metavar="JSON",
                        help="speculative decoding, as vLLM's JSON dict, e.g. "
                        '\'{"method": "ngram", "num_speculative_tokens": 4}\' '
                        "(overrides the preset's `speculative` section)")
    add_http_flags(parser)
    _add_engine_flags(parser)
    return parser


def _json_list(text: str) -> list[str]:
    """vLLM's form for the CORS flags: a JSON list of strings."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def preset_for(model: str | None) -> Path | None:
    """configs/gpt2-xl.yaml for `gpt2-xl`, `openai-community/gpt2-xl` or `/models/gpt2-xl`."""
    if not model:
        return None
    preset = PRESET_DIR / f"{Path(model).name.lower()}.yaml"
    return preset if preset.is_file() else None


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    overrides = {name: getattr(args, name) for name in flat_field_names()}
    overrides["speculative_config"] = _speculative_json(args.speculative_config)
    path = args.config or preset_for(args.model or ModelConfig.model)
    if path is not None and not Path(path).is_file():
        raise FileNotFoundError(f"--config {path}: no such file")
    if path is not None and not args.config:
        logger.info("config: %s (picked from the model name; --config overrides)", path)
    return load_config(path, **overrides)


def _speculative_json(text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"invalid config: --speculative-config is not JSON ({exc}): "
                          f"{text!r}") from None


def exit_on_startup_error(exc: Exception, log_level: str) -> None:
    """One line naming the cause and a non-zero exit; the traceback only at debug level."""
    if log_level == "debug":
        raise exc
    cause = " ".join(str(exc).split()) or type(exc).__name__
    sys.exit(f"gpt2-serve: error: {cause}")


def _log_startup(core: EngineProcess, config: EngineConfig, args: argparse.Namespace,
                 model_name: str, started: float) -> None:
    model, cache, sched, info = config.model, config.cache, config.scheduler, core.info
    logger.info("ready in %.1f s: %s", time.perf_counter() - started, info.startup_phases)
    logger.info("gpt2-serve %s: serving %s as %r on http://%s:%d (engine core: pid %s)",
                version(), model.model, model_name, args.host, args.port, core.info.pid)
    logger.info("model: device=%s dtype=%s attention=%s enforce_eager=%s", info.device,
                info.dtype, info.attention_backend, model.enforce_eager)
    logger.info("kv cache: %d blocks x %d tokens, prefix caching %s", info.num_kv_blocks,
                cache.block_size, "on" if cache.enable_prefix_caching else "off")
    logger.info("scheduler: max_model_len=%d max_num_seqs=%d max_num_batched_tokens=%d "
                "policy=%s", sched.max_model_len, sched.max_num_seqs,
                sched.max_num_batched_tokens, sched.scheduling_policy)
    if config.speculative is not None:
        logger.info("speculative decoding: %s", config.speculative)
    logger.info("server: max_queued_requests=%d max_n=%d shutdown_timeout=%.0fs api_key=%s",
                args.max_queued_requests, args.max_n, args.shutdown_timeout,
                "set" if args.api_key else "off")


def main(argv: list[str] | None = None) -> None:
    started = time.perf_counter()
    parser = build_parser()
    args = parser.parse_args(argv)
    if min(args.max_queued_requests, args.max_n, args.max_prompts_per_request,
           args.api_server_count) < 1:
        parser.error("--max-queued-requests, --max-n, --max-prompts-per-request and "
                     "--api-server-count must be >= 1")
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in [0, 65535], got {args.port}")
    if args.shutdown_timeout < 0 or args.watchdog_timeout < 1:
        parser.error("--shutdown-timeout must be >= 0 and --watchdog-timeout >= 1 (the idle "
                     "engine core answers every 0.2 s)")
    if args.watchdog_exit_timeout is not None and \
            args.watchdog_exit_timeout < args.watchdog_timeout:
        parser.error("--watchdog-exit-timeout must be >= --watchdog-timeout")
    if args.max_request_body_bytes < 1:
        parser.error("--max-request-body-bytes must be >= 1")
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    try:
        config = engine_config_from_args(args)
        chat_template = resolve_chat_template(args.chat_template, config.model.model)
        # bound before the model loads (as vLLM does): a busy port fails in a second
        sock = listening_socket(args.host, args.port)
        core = EngineProcess(config, num_clients=args.api_server_count)
    except Exception as exc:  # noqa: BLE001 - every startup failure gets the same one line
        exit_on_startup_error(exc, args.log_level)
    model_name = args.served_model_name or served_name_of(config.model.model)
    _log_startup(core, config, args, model_name, started)
    logger.info("chat template: %s", "none (chat requests get 400; --chat-template sets one)"
                if chat_template is None else f"{len(chat_template)} characters")
    settings = ServerSettings(
        model_name=model_name, max_queued_requests=args.max_queued_requests, max_n=args.max_n,
        max_prompts_per_request=args.max_prompts_per_request, api_key=args.api_key,
        max_body_bytes=args.max_request_body_bytes, log_interval=args.log_interval,
        watchdog_timeout=args.watchdog_timeout,
        watchdog_exit_timeout=args.watchdog_exit_timeout,
        shutdown_timeout=args.shutdown_timeout, enable_docs=not args.disable_fastapi_docs,
        scheduling_policy=config.scheduler.scheduling_policy,
        cache_config_info=cache_config_labels(config.cache, core.info.num_kv_blocks),
        chat_template=chat_template,
        trust_request_chat_template=args.trust_request_chat_template,
        allowed_origins=tuple(args.allowed_origins), allowed_methods=tuple(args.allowed_methods),
        allowed_headers=tuple(args.allowed_headers), allow_credentials=args.allow_credentials)
    if args.api_server_count > 1:
        options = ApiServerOptions(settings, args.host, args.port, args.log_level,
                                   HttpLimits.from_args(args))
        sys.exit(run_api_servers(core, sock, options))
    app = create_app(CoreClient(core.info, owner=core), settings)
    sys.exit(serve_app(app, args.host, args.port, args.log_level, args.shutdown_timeout,
                       sock, HttpLimits.from_args(args)))


def served_name_of(model: str) -> str:
    """A local directory is served under its last component: the server's filesystem layout
    is nobody's business (metrics, /v1/models). A hub id is served as it is."""
    path = Path(model)
    return path.name if path.is_dir() else model


if __name__ == "__main__":
    main()
