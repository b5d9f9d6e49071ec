"""The OpenAPI 3.1 document of `nonstop serve`, built from the pydantic models and served at
`GET /openapi.json`: the request schemas the server validates with (serve/schema.py), the response
schemas it builds its answers from (serve/responses.py), and every status a route answers.

The document is the contract the fuzz tests check the server against (tests/serve/test_fuzz.py:
schemathesis generates requests from it, valid and invalid, and checks each answer's status,
content type and body against it), and a client generator can read it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from nonstop import __version__
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


def _post(summary: str, request: type[BaseModel], answer: type[BaseModel], streams: bool) -> dict[str, Any]:
    ok = _json(answer)
    if streams:  # with "stream": true: server-sent events, `data: <chunk JSON>` lines, then `data: [DONE]`
        ok["text/event-stream"] = {"schema": {"type": "string"}}
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": _json(request)},
            "responses": {
                "200": {"description": "The completion(s)" + (", or its stream" if streams else ""), "content": ok},
                **{code: {"description": text, "content": _json(r.ErrorResponse)} for code, text in _ERRORS.items()},
            },
        }
    }


def _get(summary: str, answer: type[BaseModel] | None, codes: tuple[str, ...] = ()) -> dict[str, Any]:
    ok: dict[str, Any] = {"description": summary}
    ok["content"] = _json(answer) if answer is not None else {"application/json": {"schema": {"type": "object"}}}
    errors = {code: {"description": _ERRORS[code], "content": _json(r.ErrorResponse)} for code in codes}
    return {"get": {"summary": summary, "responses": {"200": ok, **errors}}}


def openapi(model_name: str, api_key: bool) -> dict[str, Any]:
    """The document for a server of `model_name`; with `api_key`, the routes that need the bearer key say so."""
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
    paths = {
        "/health": _get("Liveness, the model and its policy_version, running and waiting requests", r.Health),
        "/v1/models": _get("The served model", r.ModelList, ("401",)),
        "/v1/completions": _post(
            "A completion of one prompt (text or token ids)", CompletionRequest, r.CompletionResponse, streams=True
        ),
        "/v1/chat/completions": _post(
            "A reply to a conversation, through the model's chat template",
            ChatRequest,
            r.ChatCompletionResponse,
            streams=True,
        ),
        "/inference/v1/generate": _post(
            "vLLM's token-level generate: token ids in, token ids out",
            GenerateRequest,
            r.GenerateResponse,
            streams=False,
        ),
        PATH: _get("This document", None),
    }
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": f"nonstop serve: {model_name}",
            "version": __version__,
            "description": "An OpenAI-compatible server over nonstop's engine. Every choice carries the `nonstop` "
            "extension: the engine's token ids, behaviour logprobs and the policy_version of each token.",
        },
        "paths": paths,
        "components": {"schemas": defs["$defs"]},
    }
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, item in paths.items():
            if path.startswith(("/v1/", "/inference/")):
                for op in item.values():
                    op["security"] = [{"bearer": []}]
    return doc
