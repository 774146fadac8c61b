"""Any request body, on every endpoint: a 2xx answer, or a 4xx in that API's error schema, never a 500. Bodies are
drawn around valid requests (right field names with values of any JSON shape, strings with any code point, lone
surrogates included) so that most of them get past the first check."""

from __future__ import annotations

import http.client
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from moe_jax.serving.process import running_server

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "tiny-moe"
NAME = "tiny-moe"

any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=12)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**65), 2**65) | st.floats(allow_nan=True) | any_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(any_text, inner, max_size=3),
    max_leaves=8,
)


def maybe(valid):
    """Mostly (nine in ten) a valid value, sometimes anything."""
    return st.integers(0, 9).flatmap(lambda i: valid if i else json_values)


text_part = st.fixed_dictionaries({"type": maybe(st.just("text")), "text": maybe(any_text)})
tool_call = st.fixed_dictionaries(
    {"type": maybe(st.just("function")), "function": maybe(st.fixed_dictionaries({"name": maybe(any_text)}))},
    optional={"id": maybe(any_text)},
)
openai_message = st.fixed_dictionaries(
    {
        "role": maybe(st.sampled_from(["system", "user", "assistant", "tool", "developer"])),
        "content": maybe(st.one_of(any_text, st.lists(text_part, max_size=2))),
    },
    optional={"tool_calls": maybe(st.lists(tool_call, max_size=2)), "name": maybe(any_text)},
)
sampling = {
    "temperature": maybe(st.floats(0, 2)),
    "top_p": maybe(st.floats(0.1, 1)),
    "seed": maybe(st.integers(0, 100)),
    "stop": maybe(st.lists(any_text.filter(bool), max_size=3)),
    "stream": maybe(st.booleans()),
    "logit_bias": maybe(st.dictionaries(st.integers(0, 40).map(str), st.floats(-100, 100), max_size=2)),
    "presence_penalty": maybe(st.floats(-2, 2)),
}
chat_body = st.fixed_dictionaries(
    {"model": st.just(NAME), "messages": maybe(st.lists(openai_message, min_size=1, max_size=3))},
    optional={
        "max_tokens": maybe(st.integers(1, 4)),
        "tools": maybe(
            st.lists(
                st.fixed_dictionaries(
                    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": maybe(any_text)})}
                ),
                max_size=2,
            )
        ),
        "tool_choice": json_values,
        "chat_template_kwargs": maybe(st.dictionaries(any_text, json_values, max_size=2)),
        "response_format": json_values,
        "grammar": maybe(any_text),
        "n": json_values,
        "logprobs": json_values,
        "top_logprobs": json_values,
        **sampling,
    },
)
completion_body = st.fixed_dictionaries(
    {
        "model": st.just(NAME),
        "prompt": maybe(st.one_of(any_text, st.lists(st.integers(-5, 70), max_size=6))),
        "max_tokens": maybe(st.integers(1, 4)),
    },
    optional={"echo": json_values, "parse_special_tokens": maybe(st.booleans()), **sampling},
)
anthropic_block = st.one_of(
    st.fixed_dictionaries({"type": maybe(st.just("text")), "text": maybe(any_text)}),
    st.fixed_dictionaries(
        {"type": st.just("tool_use"), "id": maybe(any_text), "name": maybe(any_text), "input": json_values}
    ),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": maybe(any_text), "content": json_values}),
)
anthropic_body = st.fixed_dictionaries(
    {
        "model": st.just(NAME),
        "max_tokens": maybe(st.integers(1, 4)),
        "messages": maybe(
            st.lists(
                st.fixed_dictionaries(
                    {
                        "role": maybe(st.sampled_from(["user", "assistant"])),
                        "content": maybe(st.one_of(any_text, st.lists(anthropic_block, max_size=2))),
                    }
                ),
                min_size=1,
                max_size=3,
            )
        ),
    },
    optional={
        "system": maybe(st.one_of(any_text, st.lists(text_part, max_size=2))),
        "stop_sequences": maybe(st.lists(any_text.filter(bool), max_size=3)),
        "tools": maybe(st.lists(st.fixed_dictionaries({"name": maybe(any_text)}), max_size=2)),
        "thinking": json_values,
        "stream": maybe(st.booleans()),
        "temperature": maybe(st.floats(0, 1)),
    },
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(["--model", str(MODEL)], tmp_path_factory.mktemp("properties") / "server.log") as s:
        yield s


def post(server, path: str, body) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        data = json.dumps(body).encode("utf-8", "surrogatepass")  # (a lone surrogate goes as JSON's \\udXXX)
        connection.request("POST", path, data, {"content-type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def check_answer(path: str, status: int, raw: bytes):
    msg = json.loads(raw)["error"]["message"][:40] if status >= 400 and path != "/v1/messages" else ""
    event(f"status {status} {msg}")
    assert status < 500, (status, raw[:500])
    if status >= 400:
        body = json.loads(raw)
        if path == "/v1/messages":
            assert body["type"] == "error" and isinstance(body["error"]["message"], str), body
        else:
            assert set(body) == {"error"} and isinstance(body["error"]["message"], str), body
    elif raw.startswith(b"data: ") or raw.startswith(b"event: "):
        assert b'"error"' not in raw or b"generation failed" not in raw, raw[-500:]
    else:
        json.loads(raw)


PROPERTY_SETTINGS = settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


@PROPERTY_SETTINGS
@given(body=st.one_of(chat_body, json_values))
def test_chat_completions_never_500(server, body):
    check_answer("/v1/chat/completions", *post(server, "/v1/chat/completions", body))


@PROPERTY_SETTINGS
@given(body=st.one_of(completion_body, json_values))
def test_completions_never_500(server, body):
    check_answer("/v1/completions", *post(server, "/v1/completions", body))


@PROPERTY_SETTINGS
@given(body=st.one_of(anthropic_body, json_values))
def test_messages_never_500(server, body):
    check_answer("/v1/messages", *post(server, "/v1/messages", body))
