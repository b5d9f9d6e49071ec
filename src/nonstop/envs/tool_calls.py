"""A plain-text tool-call syntax a tiny character-level model can write, and its parser.

Chat templates of large models wrap a tool call in JSON inside special tokens
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`): dozens of tokens a 0.5 M-parameter
model with a character vocabulary would have to learn before it could call anything. This
syntax is as short as a call can be and still name the tool and carry its arguments:

    @NAME ARGUMENTS

A reply is a tool call when its text starts with `@`. NAME is the tool's name (letters, digits,
`_`, `-`, `.`), one of the tools the request offered. ARGUMENTS is the rest of the reply after one
space, either
- a JSON object: the arguments as they are (`@add {"a": 2, "b": 3}`), or
- plain text, when the tool has exactly one parameter: that parameter's value, converted by its
  JSON-schema type (`integer`, `number`, `boolean`; text otherwise): `@calc 23*7` is
  `calc(expression="23*7")`.

One call per reply; text before the `@` makes the reply plain text. `format_call` writes a call
in the form `parse_reply` reads back (the single-parameter form when it applies), so a chat that
is rendered again gives the text the model wrote for calls it wrote that way.

Parse outcomes follow `renderers.base.ToolCallParseStatus` (the statuses verifiers reads): a
name not offered is `unknown_tool`, bad JSON `invalid_json`, arguments that do not fit a
one-parameter tool `malformed_structure`, `@` alone `missing_name`. A reply whose call is not
`ok` keeps its text as content, so what the model wrote stays in the conversation.

Plain Python, no dependency: the verifiers renderer (envs/verifiers/renderer.py) uses it, and so
could any chat front end that serves these models with tools.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

MARK = "@"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")

OK, UNKNOWN_TOOL, INVALID_JSON, MALFORMED, MISSING_NAME = (
    "ok",
    "unknown_tool",
    "invalid_json",
    "malformed_structure",
    "missing_name",
)


@dataclass(frozen=True)
class Call:
    """One tool call as parsed: `arguments` is a dict when `status` is 'ok'."""

    raw: str
    name: str | None = None
    arguments: dict[str, Any] | str | None = None
    status: str = OK


@dataclass(frozen=True)
class Reply:
    """A parsed reply: its content (empty for an ok call) and its call, if it tried one."""

    content: str
    calls: list[Call] = field(default_factory=list)


def tool_specs(tools: list[dict] | None) -> dict[str, dict]:
    """name -> JSON-schema parameters, from OpenAI-style tool dicts (`{"type": "function",
    "function": {...}}`) or bare function dicts (`{"name", "parameters"}`)."""
    out = {}
    for tool in tools or []:
        fn = tool.get("function", tool)
        out[fn["name"]] = fn.get("parameters") or {}
    return out


def _only_parameter(schema: dict) -> tuple[str, dict] | None:
    props = schema.get("properties") or {}
    return next(iter(props.items())) if len(props) == 1 else None


def _convert(text: str, prop: dict) -> Any:
    kind = prop.get("type")
    if kind == "integer":
        return int(text)
    if kind == "number":
        return float(text)
    if kind == "boolean":
        if text not in ("true", "false"):
            raise ValueError(f"expected true or false, got {text!r}")
        return text == "true"
    if kind in (None, "string"):
        return text
    return json.loads(text)


def _arguments(rest: str, schema: dict) -> tuple[dict[str, Any] | str, str]:
    if rest.startswith("{"):
        try:
            args = json.loads(rest)
        except json.JSONDecodeError:
            return rest, INVALID_JSON
        return (args, OK) if isinstance(args, dict) else (rest, INVALID_JSON)
    props = schema.get("properties") or {}
    if not props:
        return ({}, OK) if not rest else (rest, MALFORMED)
    only = _only_parameter(schema)
    if only is None:
        return rest, MALFORMED  # several parameters need the JSON form
    try:
        return {only[0]: _convert(rest, only[1])}, OK
    except ValueError:
        return rest, MALFORMED


def parse_reply(text: str, tools: list[dict] | None) -> Reply:
    """The reply's content and tool call (see the module docstring for the syntax)."""
    if not text.startswith(MARK):
        return Reply(text)
    body = text[len(MARK) :]
    m = _NAME.match(body)
    if m is None:
        return Reply(text, [Call(text, status=MISSING_NAME)])
    name, rest = m.group(0), body[m.end() :]
    if rest and not rest.startswith(" "):
        return Reply(text, [Call(text, name, rest, MALFORMED)])
    rest = rest[1:]
    specs = tool_specs(tools)
    if name not in specs:
        return Reply(text, [Call(text, name, rest, UNKNOWN_TOOL)])
    args, status = _arguments(rest, specs[name])
    return Reply("" if status == OK else text, [Call(text, name, args, status)])


def format_call(name: str, arguments: dict[str, Any] | str, tools: list[dict] | None) -> str:
    """The text of a call, in the form `parse_reply` reads back: the plain single-parameter form
    when the tool has one parameter and its value is a scalar whose text converts back to it,
    else the JSON form. `arguments` may be a JSON text (OpenAI's wire form)."""
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    if not args:
        return f"{MARK}{name}"
    only = _only_parameter(tool_specs(tools).get(name, {}))
    if only is not None and set(args) == {only[0]}:
        value = args[only[0]]
        text: str | None = None
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (str, int, float)):
            text = str(value)
        if text is not None and not text.startswith("{"):
            try:
                if _convert(text, only[1]) == value:
                    return f"{MARK}{name} {text}"
            except ValueError:
                pass
    return f"{MARK}{name} {json.dumps(args, separators=(', ', ': '))}"
