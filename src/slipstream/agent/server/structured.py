"""Structured outputs: ``response_format`` -> an llguidance grammar the engine enforces.

    {"type": "json_object"}                     -> any JSON object
    {"type": "json_schema", "json_schema": {"schema": S, "strict": ...}} -> JSON valid under S
    {"type": "text"} or absent                  -> no grammar

The schema is compiled and checked here, off the event loop, before the request reaches the
engine: a schema that llguidance cannot enforce (an unsupported keyword, a broken ``$ref``)
is a 400 whose message is llguidance's, which names the keyword. A grammar is enforced
token by token (engine/grammar.py), so ``strict`` changes nothing: the output always
matches, unless ``max_tokens`` cuts it short (``finish_reason`` "length").
"""

from __future__ import annotations

import asyncio
from typing import Any

from slipstream.agent.engine.sampling.grammar import json_schema_grammar
from slipstream.contracts.errors import bad_request
from slipstream.agent.server.prepare import ServingContext
from slipstream.agent.server.protocol import ResponseFormat

ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}


async def checked_grammar(ctx: ServingContext, grammar: str, param: str, what: str) -> str:
    """``grammar`` if the engine's grammar compiler accepts it, else a 400 on ``param``."""
    error = await asyncio.to_thread(ctx.engine.grammar.check, grammar)
    if error is not None:
        raise bad_request(f"{what} cannot be enforced: {error}", param=param)
    return grammar


async def schema_grammar(ctx: ServingContext, schema: dict[str, Any], param: str,
                         what: str) -> str:
    try:
        grammar = json_schema_grammar(schema)
    except ValueError as error:
        raise bad_request(f"{what} is not a usable JSON schema: {error}", param=param) from None
    return await checked_grammar(ctx, grammar, param, what)


async def response_format_grammar(ctx: ServingContext,
                                  response_format: ResponseFormat | None) -> str | None:
    """The grammar that enforces ``response_format``; None for plain text."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return await schema_grammar(ctx, ANY_JSON_OBJECT, "response_format", "json_object")
    spec = response_format.json_schema
    assert spec is not None  # the protocol requires it for json_schema
    schema = spec.json_schema if spec.json_schema is not None else {}
    return await schema_grammar(ctx, schema, "response_format.json_schema.schema",
                                f"the schema {spec.name!r}")
