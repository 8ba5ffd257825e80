"""`gpt2-serve` / `python -m server`: build the engine, then serve it with uvicorn.

Every engine setting is a flag named after its config field (`--block-size`, `--max-num-seqs`,
`--enable-prefix-caching/--no-enable-prefix-caching`, ...), applied on top of `--config`.
SIGTERM stops accepting connections, lets in-flight requests finish for up to
`--shutdown-timeout` seconds, then exits.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from typing import Any

import uvicorn

from engine.core.config import (CacheConfig, ConfigError, EngineConfig, ModelConfig,
                           SchedulerConfig, flat_field_names, load_config)
from server.app import ServerSettings, create_app, version

logger = logging.getLogger("gpt2serve")
CONFIG_SECTIONS = (ModelConfig, CacheConfig, SchedulerConfig)


def _config_fields() -> dict[str, dataclasses.Field[Any]]:
    by_name = {f.name: f for section in CONFIG_SECTIONS for f in dataclasses.fields(section)}
    return {name: by_name[name] for name in flat_field_names()}


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per config field; unset flags stay None so the YAML preset keeps its value."""
    group = parser.add_argument_group("engine (override --config)")
    for name, field in _config_fields().items():
        flag = "--" + name.replace("_", "-")
        default = field.default if field.default is not dataclasses.MISSING else None
        help_text = f"default: {default}"
        kind = str(field.type)
        if kind == "bool":
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                               default=None, help=help_text)
            continue
        parse = int if "int" in kind else float if "float" in kind else str
        group.add_argument(flag, dest=name, type=parse, default=None, help=help_text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpt2-serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML preset from configs/ (sections model, cache, "
                        "scheduler)")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", help="the name clients send as `model` "
                        "(default: the --model value)")
    parser.add_argument("--max-queued-requests", type=int, default=256,
                        help="requests waiting for the engine before new ones get 503")
    parser.add_argument("--max-n", type=int, default=16, help="cap on `n` per request")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests get to finish after SIGTERM")
    parser.add_argument("--api-key", help="require `Authorization: Bearer KEY` on /v1 routes")
    parser.add_argument("--log-interval", type=float, default=10.0,
                        help="seconds between throughput log lines (0: off)")
    parser.add_argument("--log-level", default="info")
    _add_engine_flags(parser)
    return parser


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    overrides = {name: getattr(args, name) for name in flat_field_names()}
    return load_config(args.config, **overrides)


def _log_startup(engine: Any, config: EngineConfig, args: argparse.Namespace,
                 model_name: str) -> None:
    stats = engine.stats()
    model, cache, sched = config.model, config.cache, config.scheduler
    runner = getattr(engine, "runner", None)  # resolved values ("auto" -> what was chosen)
    logger.info("gpt2-serve %s: serving %s as %r on http://%s:%d", version(), model.model,
                model_name, args.host, args.port)
    logger.info("model: device=%s dtype=%s attention=%s enforce_eager=%s",
                getattr(runner, "device", model.device), getattr(runner, "dtype", model.dtype),
                getattr(runner, "attention_backend", model.attention_backend),
                model.enforce_eager)
    logger.info("kv cache: %d blocks x %d tokens, prefix caching %s", stats.num_total_blocks,
                cache.block_size, "on" if cache.enable_prefix_caching else "off")
    logger.info("scheduler: max_model_len=%d max_num_seqs=%d max_num_batched_tokens=%d",
                sched.max_model_len, sched.max_num_seqs, sched.max_num_batched_tokens)
    logger.info("server: max_queued_requests=%d max_n=%d shutdown_timeout=%.0fs api_key=%s",
                args.max_queued_requests, args.max_n, args.shutdown_timeout,
                "set" if args.api_key else "off")


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_queued_requests < 1 or args.max_n < 1 or args.shutdown_timeout < 0:
        parser.error("--max-queued-requests and --max-n must be >= 1, --shutdown-timeout >= 0")
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = engine_config_from_args(args)
    except ConfigError as exc:
        sys.exit(f"gpt2-serve: {exc}")
    from engine import LLMEngine  # heavy (torch): only once the arguments are good

    engine = LLMEngine(config)
    model_name = args.served_model_name or config.model.model
    _log_startup(engine, config, args, model_name)
    settings = ServerSettings(model_name=model_name,
                              max_queued_requests=args.max_queued_requests, max_n=args.max_n,
                              api_key=args.api_key, log_interval=args.log_interval)
    uvicorn.Server(uvicorn.Config(
        create_app(engine, settings), host=args.host, port=args.port,
        log_level=args.log_level, timeout_graceful_shutdown=args.shutdown_timeout)).run()


if __name__ == "__main__":
    main()
