"""The API fields clients reach for beyond the text itself, through the official openai and anthropic SDKs:
log-probabilities (the model's own, checked against its logits offline), a single model's card, a request that
leaves out `model`, and Anthropic's token count."""

from __future__ import annotations

import numpy as np
import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

import moe_jax  # noqa: E402
from tests.test_serve import MODEL, NAME, chat_tokens  # noqa: E402


@pytest.fixture(scope="module")
def offline():
    return moe_jax.load_model(MODEL)


@pytest.fixture(scope="module")
def client(bundled_server):
    return openai.OpenAI(base_url=bundled_server.url + "/v1", api_key="unused", max_retries=0)


def model_logprobs(model, prompt: list[int], generated: list[int]) -> np.ndarray:
    """log-softmax over the vocabulary at each generated token's position [len(generated), vocab] (float64)."""
    ids = np.asarray([prompt + generated])
    logits = np.asarray(model.logits(ids), np.float64)[0, len(prompt) - 1 : len(prompt) - 1 + len(generated)]
    return (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )


def token_text(model, token: int) -> str:
    return model.tokenizer.decode([token], skip_special_tokens=False)


def check_against_model(model, prompt: list[int], entries: list[tuple[str, float, list[tuple[str, float]]]], top: int):
    """`entries` (token text, logprob, top (text, logprob)) are the greedy continuation of `prompt` with the
    model's own log-probabilities (1e-4) and its `top` most likely tokens at each position."""
    generated = []
    for text, _, _ in entries:  # the greedy tokens: argmax at each step, whose text the entry names
        logprobs = model_logprobs(model, prompt, generated + [0])[-1]
        best = int(logprobs.argmax())
        assert token_text(model, best) == text
        generated.append(best)
    table = model_logprobs(model, prompt, generated)
    for position, (token, (_, logprob, tops)) in enumerate(zip(generated, entries, strict=True)):
        assert abs(logprob - table[position, token]) < 1e-4, (position, logprob, table[position, token])
        order = np.argsort(-table[position], kind="stable")[:top]
        assert [t for t, _ in tops] == [token_text(model, int(t)) for t in order]
        np.testing.assert_allclose([lp for _, lp in tops], table[position, order], atol=1e-4)


def test_completion_logprobs_are_the_models_log_softmax(client, offline):
    text = "copy srel >"
    answer = client.completions.create(model=NAME, prompt=text, temperature=0, max_tokens=6, logprobs=3)
    lp = answer.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) > 0
    assert "".join(lp.tokens) == answer.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    entries = [
        (t, v, sorted(top.items(), key=lambda kv: -kv[1]))
        for t, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True)
    ]
    check_against_model(offline, offline.tokenizer.encode(text), entries, 3)
    plain = client.completions.create(model=NAME, prompt=text, temperature=0, max_tokens=6)
    assert plain.choices[0].logprobs is None and plain.choices[0].text == answer.choices[0].text


def test_chat_logprobs_whole_and_streamed(client, offline):
    ask = dict(model=NAME, messages=[{"role": "user", "content": "copy wvdkse >"}], temperature=0, max_tokens=10)
    whole = client.chat.completions.create(**ask, logprobs=True, top_logprobs=2)
    content = whole.choices[0].logprobs.content
    assert "".join(e.token for e in content) == whole.choices[0].message.content
    assert all(e.bytes == list(e.token.encode()) for e in content)
    entries = [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in content]
    check_against_model(offline, chat_tokens(offline, "copy wvdkse >"), entries, 2)

    chunks = list(client.chat.completions.create(**ask, logprobs=True, top_logprobs=2, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    # only the chosen token's: top_logprobs 0
    bare = client.chat.completions.create(**ask, logprobs=True)
    assert [e.logprob for e in bare.choices[0].logprobs.content] == [e.logprob for e in content]
    assert all(e.top_logprobs == [] for e in bare.choices[0].logprobs.content)


def test_logprobs_do_not_change_what_is_sampled(client):
    ask = dict(model=NAME, prompt="reverse mnbvc >", temperature=1.0, seed=11, max_tokens=12)
    plain = client.completions.create(**ask)
    with_logprobs = client.completions.create(**ask, logprobs=0)
    assert with_logprobs.choices[0].text == plain.choices[0].text
    assert all(top == {} for top in with_logprobs.choices[0].logprobs.top_logprobs)
    assert all(v <= 0 for v in with_logprobs.choices[0].logprobs.token_logprobs)


def test_logprob_requests_out_of_range_are_400s(client):
    messages = [{"role": "user", "content": "copy ab >"}]
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        client.chat.completions.create(model=NAME, messages=messages, top_logprobs=2, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=NAME, messages=messages, logprobs=True, top_logprobs=21, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model=NAME, prompt="copy ab >", logprobs=-1, max_tokens=2)


def test_one_models_card_and_a_request_without_a_model(bundled_server, client):
    card = client.models.retrieve(NAME)
    assert card.id == NAME and card.owned_by == "moe_jax"
    assert card.model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError, match="serves 'tiny-moe'"):
        client.models.retrieve("Qwen/Qwen3-30B-A3B")
    status, answer, _ = bundled_server.post("/v1/completions", {"prompt": "copy ab >", "max_tokens": 3})
    assert status == 200 and answer["model"] == NAME
    named = client.completions.create(model=NAME, prompt="copy ab >", max_tokens=3, temperature=0)
    status, answer, _ = bundled_server.post(
        "/v1/completions", {"prompt": "copy ab >", "max_tokens": 3, "temperature": 0}
    )
    assert answer["choices"][0]["text"] == named.choices[0].text


def test_anthropic_count_tokens_is_the_prompt_a_message_would_take(bundled_server):
    client = anthropic.Anthropic(base_url=bundled_server.url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "sort hgfedcba >"}]
    system = "Answer briefly."
    counted = client.messages.count_tokens(model=NAME, messages=messages, system=system)
    sent = client.messages.create(model=NAME, messages=messages, system=system, max_tokens=2)
    assert counted.input_tokens == sent.usage.input_tokens + (sent.usage.cache_read_input_tokens or 0) > 5
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="claude-sonnet-5", messages=messages)
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model=NAME, messages=[])


def test_n_choices_equal_n_requests_seeded_one_apart(client):
    ask = dict(model=NAME, prompt="reverse qwerty >", temperature=1.0, max_tokens=10)
    together = client.completions.create(**ask, n=3, seed=5)
    alone = [client.completions.create(**ask, seed=5 + i) for i in range(3)]
    assert [c.index for c in together.choices] == [0, 1, 2]
    assert [c.text for c in together.choices] == [a.choices[0].text for a in alone]
    assert len({c.text for c in together.choices}) > 1  # they are sampled apart
    assert together.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert together.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)


def test_n_chat_choices_streamed_equal_the_whole_answer(client):
    ask = dict(model=NAME, messages=[{"role": "user", "content": "sort qmzka >"}], temperature=1.0, max_tokens=12)
    whole = client.chat.completions.create(**ask, n=2, seed=9, logprobs=True)
    chunks = list(
        client.chat.completions.create(
            **ask, n=2, seed=9, logprobs=True, stream=True, stream_options={"include_usage": True}
        )
    )
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
        assert mine[-1].finish_reason == choice.finish_reason
        streamed = [e.logprob for c in mine if c.logprobs for e in c.logprobs.content]
        assert streamed == [e.logprob for e in choice.logprobs.content]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    greedy = client.chat.completions.create(**{**ask, "temperature": 0}, n=2)
    assert greedy.choices[0].message.content == greedy.choices[1].message.content
    with pytest.raises(openai.BadRequestError, match="n"):
        client.chat.completions.create(**ask, n=17)
