"""Property-based tests (hypothesis): any request body gives a parsed call or a 400-class
BadRequest naming the field, never another exception; over real HTTP, any body gives a 2xx or a
4xx with a JSON error, never a 500 or a hang; any config tree or --set override gives a Config
or a ConfigError, never another exception."""

from __future__ import annotations

import json
import string

import aiohttp
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_server import _run_with_server  # noqa: E402

from nonstop.config import Config, ConfigError, load_config  # noqa: E402
from nonstop.serve.protocol import BadRequest, parse_chat, parse_completion  # noqa: E402

FIELDS = [
    "model",
    "prompt",
    "prompt_token_ids",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "seed",
    "stop",
    "stop_token_ids",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "echo",
    "presence_penalty",
    "logit_bias",
    "best_of",
    "tools",
    "response_format",
    "user",
]

text = st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x10FFFF), max_size=12)  # surrogates included
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    text,
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.sampled_from(["role", "content", "type", "text", "include_usage", "x"]), inner, max_size=3),
    ),
    max_leaves=12,
)
message = st.fixed_dictionaries(
    {
        "role": st.one_of(st.sampled_from(["user", "system"]), values),
        "content": st.one_of(
            text,
            values,
            st.lists(
                st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": values}), max_size=3
            ),
        ),
    }
)
bodies = st.one_of(
    values,
    st.dictionaries(st.sampled_from(FIELDS), values, max_size=6),
    st.fixed_dictionaries(
        {"prompt": st.one_of(text, st.lists(st.integers(-5, 2**40), max_size=5), values)},
        optional={k: values for k in ("n", "seed", "max_tokens", "logprobs", "stream", "stream_options")},
    ),
    st.fixed_dictionaries(
        {"messages": st.lists(message, max_size=3)},
        optional={k: values for k in ("logprobs", "top_logprobs", "n", "seed", "stream")},
    ),
)


@settings(max_examples=400, deadline=None)
@given(bodies)
def test_parsing_any_body_gives_a_call_or_a_4xx_naming_the_field(body):
    for parse in (parse_completion, parse_chat):
        try:
            call = parse(body, 16)
        except BadRequest as e:
            assert 400 <= e.status < 500 and str(e)
            continue
        assert call.n >= 1 and call.params.max_new_tokens >= 1
        assert call.prompt_ids is not None or call.prompt_text or call.messages
        for s in [call.prompt_text or ""] + [m["content"] + m["role"] for m in call.messages or []]:
            s.encode("utf-8")  # whatever reaches the tokenizer is valid Unicode
        if call.params.seed is not None:
            assert -(2**63) <= call.params.seed and call.params.seed + call.n <= 2**64


def test_any_body_over_http_is_2xx_or_a_json_4xx(tiny_dir):
    """A sample of generated bodies against a real server: no 500, no hang, the engine keeps serving."""
    found: list[tuple[int, object]] = []

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(bodies, st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    def collect(body, path):
        found.append((path, body))

    collect()

    async def body_fn(url, aio, tok):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            for path, body in found:
                if isinstance(body, dict):
                    body = {**body, "max_tokens": 2} if "max_tokens" not in body else body
                raw = json.dumps(body).encode()  # ASCII: lone surrogates travel as \\ud800 escapes
                async with s.post(url + path, data=raw, headers={"Content-Type": "application/json"}) as r:
                    out = await r.json(content_type=None)
                    assert r.status < 500, (path, body, out)
                    if r.status >= 400:
                        assert (
                            out["error"]["message"]
                            and out["error"]["type"] == "invalid_request_error"
                            or r.status == 404
                        ), (path, body, out)
        assert not aio.engine.has_work()

    _run_with_server(tiny_dir, body_fn)


keys = st.sampled_from(
    [
        "run.seed",
        "run.max_steps",
        "buffer.depth",
        "buffer.max_lag",
        "trainer.lr",
        "rollout.temperature",
        "task.eval_size",
        "task.eval_fraction",
        "engine.max_seq_len",
        "transport.kind",
        "runtime.num_engines",
        "nope",
        "run",
        "run.nope.deeper",
        "",
        " ",
        "a..b",
        "trainer.ranks",
    ]
)
raw_values = st.one_of(
    st.text(alphabet=string.printable, max_size=10),
    st.integers(-(10**30), 10**30).map(str),
    st.sampled_from(["null", "[]", "{}", "true", "-1", "1e400", "nan", "[1, 2", "{a: b}"]),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(keys, raw_values).map(lambda kv: f"{kv[0]}={kv[1]}"), max_size=4))
def test_any_overrides_give_a_config_or_a_config_error(overrides):
    try:
        cfg = load_config(None, overrides)
    except ConfigError as e:
        assert str(e)
        return
    assert isinstance(cfg, Config)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.recursive(
        st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8)),
        lambda inner: st.one_of(
            st.lists(inner, max_size=3),
            st.dictionaries(
                st.sampled_from(["run", "buffer", "trainer", "seed", "depth", "lr", "kind", "x"]), inner, max_size=3
            ),
        ),
        max_leaves=10,
    )
)
def test_any_yaml_tree_gives_a_config_or_a_config_error(tmp_path, tree):
    import yaml

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(tree))
    try:
        load_config(path)
    except ConfigError as e:
        assert str(e)
