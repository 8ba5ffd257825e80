"""Chat templates: where the server's one comes from, and rendering messages with one the way
transformers' `apply_chat_template` does (a sandboxed Jinja environment with trim_blocks and
lstrip_blocks, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text, and
the variables `messages`, `add_generation_prompt`, `tools`, `documents`, `bos_token` and
`eos_token`, plus the request's `chat_template_kwargs`).

A template comes from `--chat-template` (a file, or the template itself), else from a local
checkpoint directory (`chat_template.jinja`, or `chat_template` in tokenizer_config.json).
GPT-2 checkpoints ship none: without one, chat requests are refused with a 400 saying how to
give one.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.output.tokenizer import ENDOFTEXT
from server.protocol import RequestError

JINJA_CHARS = "{}\n"  # a --chat-template value holding one of these is a template, not a path
# appended to the final message under continue_final_message: the rendered text is cut
# where it shows up
CONTINUE_MARK = "\ue000continue-final-message\ue000"
# names the server sets: chat_template_kwargs may not replace them
RESERVED_VARIABLES = frozenset({"messages", "add_generation_prompt", "tools", "documents"})


def load_chat_template(value: str) -> str:
    """--chat-template's value: the text of the file it names, else the template itself when
    it holds a Jinja character ("{", "}" or a newline), with backslash escapes such as \\n
    decoded (vLLM's rule). A value that looks like a path but cannot be read is an error."""
    try:
        return Path(value).read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:
        if not any(char in value for char in JINJA_CHARS):
            reason = exc.strerror if isinstance(exc, OSError) else str(exc)
            raise ValueError(f"--chat-template {value!r} looks like a file path, but it "
                             f"cannot be read ({reason})") from None
    return value.encode("latin-1", "backslashreplace").decode("unicode_escape")


def checkpoint_chat_template(model: str) -> str | None:
    """The template a local HF checkpoint directory ships: chat_template.jinja, else
    tokenizer_config.json's `chat_template` (a string, or the entry named "default" of a
    list of named templates). None for a hub id or a directory without one."""
    directory = Path(model)
    if not directory.is_dir():
        return None
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    config_file = directory / "tokenizer_config.json"
    if not config_file.is_file():
        return None
    template = json.loads(config_file.read_text(encoding="utf-8")).get("chat_template")
    if isinstance(template, list):
        template = next((entry.get("template") for entry in template
                         if isinstance(entry, dict) and entry.get("name") == "default"), None)
    return template if isinstance(template, str) and template else None


def resolve_chat_template(flag: str | None, model: str) -> str | None:
    """The server's template: --chat-template's, else the checkpoint's, else None. It is
    compiled here, so a broken one stops the server at startup, not at the first request."""
    template = load_chat_template(flag) if flag is not None else \
        checkpoint_chat_template(model)
    if template is not None:
        try:
            compile_template(template)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"the chat template does not compile: {exc.message} (line "
                             f"{exc.lineno})") from None
    return template


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' tojson: plain JSON, unlike Jinja's HTML-escaping one."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


_ENV = _environment()


@lru_cache(maxsize=16)  # the server's template, and a few per-request ones
def compile_template(source: str) -> jinja2.Template:
    """Raises jinja2.TemplateSyntaxError."""
    return _ENV.from_string(source)


def render_chat(template: str, messages: list[dict[str, Any]], *,
                add_generation_prompt: bool, continue_final_message: bool,
                documents: list[dict[str, Any]] | None,
                kwargs: dict[str, Any] | None) -> str:
    """The prompt text of `messages` (each content a string, or None). With
    continue_final_message the text ends where the final message's content does, so the model
    continues it. Anything the template raises is the request's problem: a 400."""
    reserved = RESERVED_VARIABLES & set(kwargs or {})
    if reserved:
        raise RequestError(f"chat_template_kwargs may not set {sorted(reserved)}: the request "
                           "fields set them", param="chat_template_kwargs")
    if continue_final_message:
        messages = _marked(messages)
    variables = {"bos_token": ENDOFTEXT, "eos_token": ENDOFTEXT, **(kwargs or {}),
                 "messages": messages, "add_generation_prompt": add_generation_prompt,
                 "tools": None, "documents": documents}
    try:
        text = compile_template(template).render(**variables)
    except jinja2.TemplateSyntaxError as exc:
        raise RequestError(f"chat_template does not compile: {exc.message} (line "
                           f"{exc.lineno})", param="chat_template") from None
    except Exception as exc:  # noqa: BLE001 - whatever the template raised, from these messages
        raise RequestError(f"the chat template could not render these messages: {exc}",
                           param="messages", code="chat_template_error") from None
    return _cut_at_mark(text) if continue_final_message else text


def _marked(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    final = messages[-1]
    if not isinstance(final.get("content"), str):
        raise RequestError("continue_final_message needs a final message with content",
                           param="continue_final_message")
    return [*messages[:-1], {**final, "content": final["content"] + CONTINUE_MARK}]


def _cut_at_mark(text: str) -> str:
    if CONTINUE_MARK not in text:
        raise RequestError("continue_final_message: the chat template does not show the final "
                           "message's content as sent, so it cannot be continued",
                           param="continue_final_message")
    return text[:text.rindex(CONTINUE_MARK)]
