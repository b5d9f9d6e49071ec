"""The plain-text tool-call syntax (envs/tool_calls.py): what parses, what does not, and that
every call `format_call` writes parses back to the same call."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from nonstop.envs.tool_calls import (
    INVALID_JSON,
    MALFORMED,
    MISSING_NAME,
    OK,
    UNKNOWN_TOOL,
    format_call,
    parse_reply,
)

CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "parameters": {"properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
ADD = {"name": "add", "parameters": {"properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}
SCALE = {"name": "scale", "parameters": {"properties": {"by": {"type": "number"}}}}
FLAG = {"name": "flag", "parameters": {"properties": {"on": {"type": "boolean"}}}}
PING = {"name": "ping", "parameters": {}}
TOOLS = [CALC, ADD, SCALE, FLAG, PING]


def test_a_reply_starting_with_the_mark_is_a_call_with_its_arguments():
    r = parse_reply("@calc 23*7", TOOLS)
    assert r.content == "" and len(r.calls) == 1
    assert (r.calls[0].name, r.calls[0].arguments, r.calls[0].status) == ("calc", {"expression": "23*7"}, OK)
    assert parse_reply('@add {"a": 2, "b": 3}', TOOLS).calls[0].arguments == {"a": 2, "b": 3}
    assert parse_reply("@scale 2.5", TOOLS).calls[0].arguments == {"by": 2.5}
    assert parse_reply("@flag true", TOOLS).calls[0].arguments == {"on": True}
    assert parse_reply("@ping", TOOLS).calls[0].arguments == {}


def test_plain_text_and_failed_calls_keep_the_text_as_content():
    assert parse_reply("161", TOOLS).calls == [] and parse_reply("161", TOOLS).content == "161"
    assert parse_reply("x @calc 1*2", TOOLS).calls == []  # the mark must come first
    cases = {
        "@nope 1": UNKNOWN_TOOL,
        '@add {"a": 2': INVALID_JSON,
        "@add [1, 2]": MALFORMED,  # not an object, and two parameters
        "@add 2 3": MALFORMED,  # two parameters need the JSON form
        "@scale fast": MALFORMED,
        "@flag yes": MALFORMED,
        "@ping now": MALFORMED,
        "@calc: 1*2": MALFORMED,
        "@": MISSING_NAME,
        "@ 1*2": MISSING_NAME,
    }
    for text, status in cases.items():
        r = parse_reply(text, TOOLS)
        assert r.content == text and [c.status for c in r.calls] == [status], text
    assert parse_reply("@calc 1*2", None).calls[0].status == UNKNOWN_TOOL  # nothing offered


scalars = st.one_of(
    st.integers(-(10**6), 10**6), st.floats(allow_nan=False, allow_infinity=False, width=32), st.booleans()
)


@given(
    expression=st.text(st.characters(blacklist_categories=("Cs",)), max_size=12),
    a=st.integers(-1000, 1000),
    b=st.integers(-1000, 1000),
    by=st.floats(allow_nan=False, allow_infinity=False, width=32),
    on=st.booleans(),
    odd=scalars,
)
def test_every_formatted_call_parses_back_to_itself(expression, a, b, by, on, odd):
    for name, args in [
        ("calc", {"expression": expression}),
        ("add", {"a": a, "b": b}),
        ("add", {"a": a}),
        ("scale", {"by": by}),
        ("flag", {"on": on}),
        ("ping", {}),
        ("calc", {"expression": odd}),  # a value of another type than the schema's: the JSON form
    ]:
        text = format_call(name, args, TOOLS)
        assert text.startswith("@" + name)
        call = parse_reply(text, TOOLS).calls[0]
        assert (call.name, call.status) == (name, OK), text
        assert call.arguments == args, text
        assert format_call(name, json.dumps(args), TOOLS) == text  # OpenAI's wire form: arguments as JSON text


def test_a_single_parameter_call_is_written_in_the_plain_form():
    assert format_call("calc", {"expression": "23*7"}, TOOLS) == "@calc 23*7"
    assert format_call("scale", {"by": 2.0}, TOOLS) == "@scale 2.0"
    assert format_call("calc", {"expression": "{x}"}, TOOLS) == '@calc {"expression": "{x}"}'
    assert format_call("add", {"a": 1, "b": 2}, TOOLS) == '@add {"a": 1, "b": 2}'
