"""Structured-output request fields, vLLM's and OpenAI's, as one StructuredOutputsParams:

    response_format      {"type": "json_object"} | {"type": "json_schema", "json_schema": {...}}
    structured_outputs   {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
    guided_json, guided_regex, guided_choice, guided_grammar   (vLLM's older names)

A request names at most one constraint. `checked_spec` compiles it without the vocabulary, off
the event loop, so a spec that cannot compile is the client's 400 and never reaches the core.
"""
from __future__ import annotations

import asyncio
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from engine.core.request import StructuredOutputsParams

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
BACKENDS = (None, "auto", "xgrammar")  # guided_decoding_backend values that ask for ours


class SpecError(ValueError):
    """A structured-output field the server cannot honour, named by `param`."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class JsonSchemaFormat(_Model):
    name: str = Field(default="schema", max_length=64)
    description: str | None = None
    # `schema` shadows a BaseModel attribute: named differently, sent as "schema"
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Model):
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None
    disable_any_whitespace: StrictBool | None = False
    # vLLM's other options, none of which changes what xgrammar is asked here
    disable_fallback: StrictBool | None = False
    disable_additional_properties: StrictBool | None = False


class StructuredFields(BaseModel):
    """The request fields, as mixed into the completion request."""
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None


def spec_of(req: StructuredFields) -> tuple[StructuredOutputsParams, str] | None:
    """The request's constraint and the field that named it; None: free text. Raises
    SpecError for two constraints at once or a backend other than xgrammar."""
    if req.guided_decoding_backend not in BACKENDS:
        raise SpecError(f"guided_decoding_backend {req.guided_decoding_backend!r} is not "
                        "available: this server's is xgrammar", "guided_decoding_backend")
    found = [found for found in (_from_response_format(req.response_format),
                                 _from_structured_outputs(req.structured_outputs),
                                 _from_guided(req)) if found is not None]
    if len(found) > 1:
        raise SpecError(f"a request takes one constraint; got {' and '.join(p for _, p in found)}",
                        found[1][1])
    return found[0] if found else None


def _from_response_format(fmt: ResponseFormat | None) -> tuple | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True), "response_format"
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise SpecError("response_format json_schema needs json_schema.schema",
                        "response_format")
    return StructuredOutputsParams(json=fmt.json_schema.json_schema), "response_format"


def _from_structured_outputs(so: StructuredOutputsRequest | None) -> tuple | None:
    if so is None:
        return None
    try:
        spec = StructuredOutputsParams(
            json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
            json_object=bool(so.json_object),
            disable_any_whitespace=bool(so.disable_any_whitespace))
    except ValueError as err:
        raise SpecError(str(err), "structured_outputs") from None
    return spec, "structured_outputs"


def _from_guided(req: StructuredFields) -> tuple | None:
    sent = [name for name in GUIDED_FIELDS if getattr(req, name) is not None]
    if not sent:
        return None
    if len(sent) > 1:
        raise SpecError(f"a request takes one constraint; got {' and '.join(sent)}", sent[1])
    name = sent[0]
    kind = name.removeprefix("guided_")
    try:
        return StructuredOutputsParams(**{kind: getattr(req, name)}), name
    except ValueError as err:
        raise SpecError(str(err).replace("structured_outputs.choice", name), name) from None


async def checked_spec(req: StructuredFields) -> StructuredOutputsParams | None:
    """spec_of, compiled once without the vocabulary (off the event loop: the first call
    imports xgrammar) so that a spec that cannot compile fails here."""
    found = spec_of(req)
    if found is None:
        return None
    spec, param = found
    from engine.structured.grammar import check

    try:
        await asyncio.to_thread(check, spec)
    except ValueError as err:
        raise SpecError(str(err), param) from None
    return spec
