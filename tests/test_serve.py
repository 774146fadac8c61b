"""The HTTP server (`python -m moe_jax.serve`) driven by the real `openai` and `anthropic` clients, against the
same prompts generated offline with `Model.generate` on the bundled model."""

from __future__ import annotations

import http.client
import json
import random
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

import moe_jax  # noqa: E402
from moe_jax.formats.prompts import render_chat  # noqa: E402
from moe_jax.serving.process import running_server  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "tiny-moe"
NAME = "tiny-moe"
LETTERS = "abcdefghijklmnopqrstuvwxyz"
GREEDY = {"temperature": 0}  # the anthropic client no longer has sampling arguments; older clients send them


def task_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [
        f"{rng.choice(['copy', 'sort', 'reverse'])} {''.join(rng.choice(LETTERS) for _ in range(rng.randint(3, 7)))} >"
        for _ in range(n)
    ]


@pytest.fixture(scope="module")
def offline():
    return moe_jax.load_model(MODEL)


@pytest.fixture(scope="module")
def server(bundled_server):
    return bundled_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat_tokens(model, text: str) -> list[int]:
    rendered = render_chat(model.tokenizer, [{"role": "user", "content": text}])
    return model.tokenizer.encode(rendered, add_special_tokens=False)


def offline_text(model, tokens: list[int], max_new: int, **sampling) -> tuple[str, list[int]]:
    out = model.generate([tokens], max_new_tokens=max_new, **sampling)[0]
    return model.tokenizer.decode(out), out


def test_chat_greedy_equals_generate_with_usage(client, offline):
    for text in ["copy srel >", "copy wvdkse >", "sort hgfedcba >", "reverse mnbvc >"]:
        answer = client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": text}], temperature=0, max_tokens=24
        )
        tokens = chat_tokens(offline, text)
        expected, out = offline_text(offline, tokens, 24)
        assert answer.choices[0].message.content == expected
        assert answer.choices[0].finish_reason == ("length" if len(out) == 24 else "stop")
        assert answer.usage.prompt_tokens == len(tokens)
        assert answer.usage.completion_tokens == len(out)
        assert answer.usage.total_tokens == len(tokens) + len(out)
        assert answer.usage.prompt_tokens_details.cached_tokens < len(tokens)


def test_completion_text_and_token_prompts(client, offline):
    text = "sort qmzka >"
    tokens = offline.tokenizer.encode(text)
    expected, out = offline_text(offline, tokens, 12)
    by_text = client.completions.create(model=NAME, prompt=text, temperature=0, max_tokens=12)
    by_ids = client.completions.create(model=NAME, prompt=tokens, temperature=0, max_tokens=12)
    assert by_text.choices[0].text == by_ids.choices[0].text == expected
    assert by_text.usage.completion_tokens == len(out)


def test_streaming_chunks_add_up_to_the_whole_answer(client, offline):
    # how finely it is chunked depends on how busy the event loop is (tokens that came meanwhile go out as one
    # chunk); tests/test_scheduler.py checks that tokens reach the loop one by one as they come
    ask = dict(
        model=NAME,
        messages=[{"role": "user", "content": "copy wvdkse >"}],
        temperature=0,
        max_tokens=60,
        extra_body={"ignore_eos": True},
    )
    whole = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(deltas) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 60

    completion_stream = client.completions.create(
        model=NAME, prompt="sort plokij >", temperature=0, max_tokens=9, stream=True
    )
    streamed = "".join(c.choices[0].text for c in completion_stream)
    assert (
        streamed
        == client.completions.create(model=NAME, prompt="sort plokij >", temperature=0, max_tokens=9).choices[0].text
    )


def test_stop_strings_cut_the_answer(client, offline):
    text = "copy wvdkse >"  # the bundled model copies plain prompts well
    full, _ = offline_text(offline, offline.tokenizer.encode(text), 24)
    assert len(full) >= 5, full
    stop = full[3:5]

    def ask(**kwargs):
        return client.completions.create(model=NAME, prompt=text, temperature=0, max_tokens=24, **kwargs)

    answer = ask(stop=[stop, "zzzz"])
    assert answer.choices[0].text == full[: full.index(stop)]
    assert answer.choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].text for c in ask(stop=stop, stream=True)) == full[: full.index(stop)]
    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": text}], temperature=0, max_tokens=24, stream=True, stop="d"
    )
    chat_full, _ = offline_text(offline, chat_tokens(offline, text), 24)
    assert "d" in chat_full
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == chat_full[: chat_full.index("d")]


def test_seeded_sampling_reproduces_and_equals_generate(client, offline):
    text = "reverse mnbvc >"

    def ask(seed):
        return (
            client.chat.completions.create(
                model=NAME,
                messages=[{"role": "user", "content": text}],
                temperature=1.5,
                top_p=0.95,
                seed=seed,
                max_tokens=16,
            )
            .choices[0]
            .message.content
        )

    expected, _ = offline_text(offline, chat_tokens(offline, text), 16, temperature=1.5, top_p=0.95, seed=7)
    assert ask(7) == ask(7) == expected
    assert len({ask(s) for s in range(6)}) > 1  # the seed matters


def test_32_concurrent_clients_share_the_batch(server, client, offline):
    texts = task_prompts(32, seed=5)
    before = server.metrics()

    def ask(text):
        return (
            client.chat.completions.create(
                model=NAME, messages=[{"role": "user", "content": text}], temperature=0, max_tokens=20
            )
            .choices[0]
            .message.content
        )

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(ask, texts))
    expected = [offline_text(offline, chat_tokens(offline, t), 20)[0] for t in texts]
    assert answers == expected
    after = server.metrics()
    steps = after["moe_jax_decode_batch_size_count"] - before["moe_jax_decode_batch_size_count"]
    up_to_4 = after['moe_jax_decode_batch_size_bucket{le="4.0"}'] - before['moe_jax_decode_batch_size_bucket{le="4.0"}']
    assert steps > up_to_4  # some steps decoded more than 4 sequences at once


def test_anthropic_messages_whole_and_streamed(server, offline):
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    text = "copy wvdkse >"
    expected, out = offline_text(offline, chat_tokens(offline, text), 20)
    message = client.messages.create(
        model=NAME, max_tokens=20, extra_body=GREEDY, messages=[{"role": "user", "content": text}]
    )
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == expected
    assert message.stop_reason == ("max_tokens" if len(out) == 20 else "end_turn")
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == len(chat_tokens(offline, text))
    assert usage.output_tokens == len(out)
    with client.messages.stream(
        model=NAME, max_tokens=20, extra_body=GREEDY, messages=[{"role": "user", "content": text}]
    ) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == expected == final.content[0].text
    assert final.usage.output_tokens == len(out)
    assert len(expected) >= 3
    stop = expected[1:3]
    cut = client.messages.create(
        model=NAME,
        max_tokens=20,
        extra_body=GREEDY,
        messages=[{"role": "user", "content": text}],
        stop_sequences=[stop],
    )
    assert cut.content[0].text == expected[: expected.index(stop)]
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)


def test_a_client_that_disconnects_frees_its_slot(server):
    before = server.metrics()
    body = {
        "model": NAME,
        "messages": [{"role": "user", "content": "copy ab >"}],
        "max_tokens": 100,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
    }
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data:")  # streaming has begun
    connection.sock.close()  # the client goes away mid-stream
    connection.close()
    deadline = time.monotonic() + 20
    key = 'moe_jax_generations_finished_total{reason="cancelled"}'
    while time.monotonic() < deadline:
        after = server.metrics()
        if after.get(key, 0) > before.get(key, 0) and after["moe_jax_running_batch_size"] == 0:
            break
        time.sleep(0.05)
    assert after.get(key, 0) == before.get(key, 0) + 1
    generated = after["moe_jax_completion_tokens_total"] - before["moe_jax_completion_tokens_total"]
    assert generated < 100  # it stopped before its 100 tokens


def test_bad_requests_get_json_errors_and_the_server_goes_on(server, client):
    status, body, _ = server.post("/v1/chat/completions", b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body, _ = server.post("/v1/chat/completions", {"model": NAME, "messages": [{"role": "nobody"}]})
    assert status == 400 and "messages.0.role" in body["error"]["message"]
    status, body, _ = server.post(
        "/v1/chat/completions", {"model": NAME, "best_of": 2, "messages": [{"role": "user", "content": "a"}]}
    )
    assert status == 400 and "best_of must be 1" in body["error"]["message"]
    long = "copy " + "ab" * 80 + " >"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": long}], max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded" and "128 tokens" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "a"}])
    status, body, _ = server.post("/v1/messages", {"model": NAME, "messages": [{"role": "user", "content": "a"}]})
    assert status == 400 and body["type"] == "error" and "max_tokens" in body["error"]["message"]
    status, body, _ = server.post(
        "/v1/messages", {"model": "x", "max_tokens": 3, "messages": [{"role": "user", "content": "a"}]}
    )
    assert status == 404 and body["error"]["type"] == "not_found_error"
    assert client.models.list().data[0].id == NAME
    answer = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "copy ab >"}], temperature=0, max_tokens=5
    )
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_full_queue_429_api_key_and_graceful_shutdown(tmp_path):
    args = [
        "--model",
        str(MODEL),
        "--max-batch",
        "1",
        "--max-queue",
        "0",
        "--api-key",
        "sesame",
        "--shutdown-timeout",
        "30",
    ]
    with running_server(args, tmp_path / "server.log") as server:
        key = {"authorization": "Bearer sesame"}
        status, body, _ = server.post("/v1/completions", {"model": NAME, "prompt": "copy a >"})
        assert status == 401 and body["error"]["type"] == "authentication_error"
        assert server.get("/health")[0] == 200  # health needs no key
        long_request = {"model": NAME, "prompt": "copy ab >", "max_tokens": 110, "ignore_eos": True, "temperature": 0}
        results = {}
        first = threading.Thread(target=lambda: results.update(first=server.post("/v1/completions", long_request, key)))
        first.start()
        deadline = time.monotonic() + 20
        while server.metrics(key)["moe_jax_running_batch_size"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        status, body, headers = server.post("/v1/completions", {"model": NAME, "prompt": "copy a >"}, key)
        assert status == 429 and body["error"]["type"] == "rate_limit_error"
        assert headers.get("retry-after") == "1"
        first.join()
        assert results["first"][0] == 200 and results["first"][1]["usage"]["completion_tokens"] == 110
        status, body, _ = server.post("/v1/completions", {"model": NAME, "prompt": "copy a >", "max_tokens": 3}, key)
        assert status == 200  # served again once the slot is free

        # SIGTERM while a request runs: it finishes, then the server exits cleanly. Running means a step has run
        # since it was sent (the batch size alone may still be the last request's, set after the step it ended in)
        steps = server.metrics(key)["moe_jax_decode_steps_total"]
        second = threading.Thread(target=lambda: results.update(last=server.post("/v1/completions", long_request, key)))
        second.start()
        while time.monotonic() < deadline + 20:
            now = server.metrics(key)
            if now["moe_jax_running_batch_size"] >= 1 and now["moe_jax_decode_steps_total"] > steps:
                break
            time.sleep(0.01)
        # uvicorn re-raises the signal once it has shut down gracefully: the exit status says SIGTERM
        assert server.stop(signal.SIGTERM) in (0, -signal.SIGTERM)
        second.join()
        assert results["last"][0] == 200 and results["last"][1]["usage"]["completion_tokens"] == 110


TOOL_CALL = '<tool_call>{"name": "lookup", "arguments": {"q": 1}}</tool_call>'


def test_reasoning_and_tool_calls_are_parsed(tmp_path, offline):
    """A copy of the bundled model whose tokenizer decodes two of the characters it answers with as a thinking
    block and as a Qwen3-style tool call, and whose template mentions both: the server returns the thinking apart
    and the tool calls structured, in both APIs, whole and streamed."""
    text = "copy srel >"
    _, out = offline_text(offline, chat_tokens(offline, text), 24)
    chars = [offline.tokenizer.decode([t]) for t in out if t != 2]
    thinking_char, call_char = chars[0], chars[-1]
    assert thinking_char != call_char, chars
    model_dir = tmp_path / "model"
    shutil.copytree(MODEL, model_dir)
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    # applied in turn to each token's text: the thinking block must not hold the character replaced after it
    replace = [(thinking_char, "<think>?!</think>"), (call_char, TOOL_CALL)]
    assert call_char not in replace[0][1]
    spec["decoder"] = {
        "type": "Sequence",
        "decoders": [
            *({"type": "Replace", "pattern": {"String": a}, "content": b} for a, b in replace),
            spec["decoder"],
        ],
    }
    (model_dir / "tokenizer.json").write_text(json.dumps(spec))
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] += "{# the model writes <think>...</think> and <tool_call>...</tool_call> #}"
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    rest = "".join(c for c in chars if c not in (thinking_char, call_char))
    calls = chars.count(call_char)

    with running_server(["--model", str(model_dir), "--served-model-name", NAME], tmp_path / "server.log") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        ask = dict(model=NAME, messages=[{"role": "user", "content": text}], temperature=0, max_tokens=24)
        message = client.chat.completions.create(**ask).choices[0]
        assert message.finish_reason == "tool_calls"
        assert message.message.content == rest
        assert message.message.model_extra["reasoning_content"] == "?!" * chars.count(thinking_char)
        assert [(c.function.name, json.loads(c.function.arguments)) for c in message.message.tool_calls] == [
            ("lookup", {"q": 1})
        ] * calls
        chunks = [c.choices[0] for c in client.chat.completions.create(**ask, stream=True) if c.choices]
        assert "".join(c.delta.content or "" for c in chunks) == rest
        assert "".join(
            (c.delta.model_extra or {}).get("reasoning_content") or "" for c in chunks
        ) == "?!" * chars.count(thinking_char)
        assert sum(len(c.delta.tool_calls or []) for c in chunks) == calls
        assert chunks[-1].finish_reason == "tool_calls"

        claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
        ask = dict(model=NAME, max_tokens=24, extra_body=GREEDY, messages=[{"role": "user", "content": text}])
        reply = claude.messages.create(**ask)
        assert reply.stop_reason == "tool_use"
        assert [b.thinking for b in reply.content if b.type == "thinking"] == ["?!"] * chars.count(thinking_char)
        assert [(b.name, b.input) for b in reply.content if b.type == "tool_use"] == [("lookup", {"q": 1})] * calls
        with claude.messages.stream(**ask) as stream:
            final = stream.get_final_message()
        assert [b.type for b in final.content] == [b.type for b in reply.content]
        assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [("lookup", {"q": 1})] * calls
