"""The OpenAPI 3.1 document of `nonstop serve`, built from the pydantic models and served at
`GET /openapi.json`: the request schemas the server validates with (serve/schema.py), the response
schemas it builds its answers from (serve/responses.py), and every status a route answers.

The document is the contract the fuzz tests check the server against (tests/serve/test_fuzz.py:
schemathesis generates requests from it, valid and invalid, and checks each answer's status,
content type and body against it), and a client generator can read it.
"""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from nonstop.serve import responses as r
from nonstop.serve.schema import ChatRequest, CompletionRequest, GenerateRequest

PATH = "/openapi.json"

_ERRORS = {
    "400": "A bad field (the error names it), malformed or too deeply nested JSON, text that is not valid "
    "Unicode, or a prompt over the engine's limits",
    "401": "Missing or wrong API key (when the server has one)",
    "404": "A model this server does not serve",
    "413": "A body over 8 MiB",
    "415": "A body that is not sent as application/json",
}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _json(model: type[BaseModel]) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(model)}}


def _events(chunk: type[BaseModel]) -> dict[str, Any]:
    """With "stream": true: server-sent events, each `data: <chunk JSON>`, the last `data: [DONE]`
    (OpenAPI 3.1 reads a text/event-stream schema as the schema of one event)."""
    data = {"type": "string", "contentMediaType": "application/json", "contentSchema": _ref(chunk)}
    return {
        "schema": {
            "type": "object",
            "required": ["data"],
            "properties": {"data": {"anyOf": [{"const": "[DONE]"}, data]}},
        }
    }


def _post(
    summary: str, request: type[BaseModel], answer: type[BaseModel], chunk: type[BaseModel] | None
) -> dict[str, Any]:
    ok = _json(answer)
    if chunk is not None:
        ok["text/event-stream"] = _events(chunk)
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": _json(request)},
            "responses": {
                "200": {"description": "The completion(s)" + (", or its stream" if chunk else ""), "content": ok},
                **{code: {"description": text, "content": _json(r.ErrorResponse)} for code, text in _ERRORS.items()},
            },
        }
    }


def _get(summary: str, answer: type[BaseModel] | None, codes: tuple[str, ...] = ()) -> dict[str, Any]:
    ok: dict[str, Any] = {"description": summary}
    ok["content"] = _json(answer) if answer is not None else {"application/json": {"schema": {"type": "object"}}}
    errors = {code: {"description": _ERRORS[code], "content": _json(r.ErrorResponse)} for code in codes}
    return {"get": {"summary": summary, "responses": {"200": ok, **errors}}}


def _bound(node: Any, fields: frozenset[str], key: str, value: int) -> None:
    """Bound every integer schema under a property named in `fields` by `key` (maximum,
    exclusiveMaximum) = `value`, unless it is bound more tightly already."""
    if isinstance(node, list):
        for item in node:
            _bound(item, fields, key, value)
    elif isinstance(node, dict):
        for name, sub in (node.get("properties") or {}).items():
            if name in fields:
                _bound_integers(sub, key, value)
        for sub in node.values():
            _bound(sub, fields, key, value)


def _bound_integers(node: Any, key: str, value: int) -> None:
    if isinstance(node, list):
        for item in node:
            _bound_integers(item, key, value)
    elif isinstance(node, dict):
        if node.get("type") == "integer":
            node[key] = min(node.get(key, value), value)
        for sub in node.values():
            _bound_integers(sub, key, value)


def openapi(
    model_name: str, api_key: bool, max_seq_len: int | None = None, vocab_size: int | None = None
) -> dict[str, Any]:
    """The document for a server of `model_name`; with `api_key`, the routes that need the bearer key
    say so; with the engine's `max_seq_len` and `vocab_size`, max_tokens and prompt token ids carry
    the bounds the server checks."""
    models: list[type[BaseModel]] = [
        CompletionRequest,
        ChatRequest,
        GenerateRequest,
        r.CompletionResponse,
        r.ChatCompletionResponse,
        r.ChatCompletionChunk,
        r.GenerateResponse,
        r.ErrorResponse,
        r.Health,
        r.ModelList,
    ]
    requests = {CompletionRequest, ChatRequest, GenerateRequest}
    _, defs = models_json_schema(
        [(m, "validation" if m in requests else "serialization") for m in models],
        ref_template="#/components/schemas/{model}",
    )
    schemas = defs["$defs"]
    for name in ("CompletionRequest", "ChatRequest", "GenerateRequest", "GenerateSamplingParams"):
        if max_seq_len is not None:  # at least one prompt token must fit beside the completion
            _bound(schemas[name], frozenset({"max_tokens", "max_completion_tokens"}), "maximum", max_seq_len - 1)
        if vocab_size is not None:
            _bound(
                schemas[name], frozenset({"prompt", "prompt_token_ids", "token_ids"}), "exclusiveMaximum", vocab_size
            )
    paths = {
        "/health": _get("Liveness, the model and its policy_version, running and waiting requests", r.Health),
        "/v1/models": _get("The served model", r.ModelList, ("401",)),
        "/v1/completions": _post(
            "A completion of one prompt (text or token ids)",
            CompletionRequest,
            r.CompletionResponse,
            r.CompletionResponse,
        ),
        "/v1/chat/completions": _post(
            "A reply to a conversation, through the model's chat template",
            ChatRequest,
            r.ChatCompletionResponse,
            r.ChatCompletionChunk,
        ),
        "/inference/v1/generate": _post(
            "vLLM's token-level generate: token ids in, token ids out",
            GenerateRequest,
            r.GenerateResponse,
            None,
        ),
        PATH: _get("This document", None),
    }
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": f"nonstop serve: {model_name}",
            "version": version("nonstop"),  # the installed package's (pyproject.toml)
            "description": "An OpenAI-compatible server over nonstop's engine. Every choice carries the `nonstop` "
            "extension: the engine's token ids, behaviour logprobs and the policy_version of each token.",
        },
        "paths": paths,
        "components": {"schemas": schemas},
    }
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, item in paths.items():
            if path.startswith(("/v1/", "/inference/")):
                for op in item.values():
                    op["security"] = [{"bearer": []}]
    return doc
