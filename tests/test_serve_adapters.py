"""Per-request LoRA adapters over HTTP (`moe-jax serve --lora-modules NAME=PATH ...`), through the official
openai and anthropic clients: each request's adapter (named as the model, as <model>:<adapter>, or in an `adapter`
field) gives what offline generation with that adapter loaded gives, and concurrent requests mixing adapters
share the batch."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

import moe_jax  # noqa: E402
from moe_jax.serving.process import running_server  # noqa: E402
from tests.test_serve import GREEDY, MODEL, NAME, chat_tokens, task_prompts  # noqa: E402

NEW = 10


@pytest.fixture(scope="module")
def adapters(bundled_adapters):
    return bundled_adapters


@pytest.fixture(scope="module")
def server(adapters, tmp_path_factory):
    modules = [f"{name}={path}" for name, path in adapters.items()]
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with running_server(["--model", str(MODEL), "--lora-modules", *modules], log) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(adapters):
    """{adapter or None: its model loaded offline}"""
    return {name: moe_jax.load_model(MODEL, adapter=adapters[name] if name else None) for name in (None, *adapters)}


def greedy(model, tokens: list[int]) -> list[int]:
    return model.generate([tokens], max_new_tokens=NEW)[0]


def offline_tokens(model, text: str) -> list[str]:
    """The greedy chat answer's tokens offline, each as the server names it in log-probabilities (a random
    adapter's answer may hold tool-call markup, which the server would parse: tokens compare exactly)."""
    eos = set(model.config.eos_token_ids)
    ids = greedy(model, chat_tokens(model, text))
    return [model.tokenizer.decode([t], skip_special_tokens=False) for t in ids if t not in eos]


def served_tokens(client, text: str, **choice) -> list[str]:
    answer = client.chat.completions.create(
        messages=[{"role": "user", "content": text}], max_tokens=NEW, temperature=0, logprobs=True, **choice
    )
    assert answer.model == choice["model"]
    return [t.token for t in answer.choices[0].logprobs.content]


def test_models_lists_each_adapter_with_its_parent(client, adapters):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {NAME, "a", "b"}
    assert cards["a"].parent == NAME and cards["a"].root == str(adapters["a"])
    assert client.models.retrieve("b").root == str(adapters["b"])


@pytest.mark.parametrize(
    "choice",
    [
        {"model": "a"},
        {"model": f"{NAME}:b"},
        {"model": NAME, "extra_body": {"adapter": "a"}},
        {"model": NAME},
    ],
    ids=["model=adapter", "model=base:adapter", "adapter field", "base"],
)
def test_each_way_of_choosing_an_adapter_equals_offline_generation_with_it(client, offline, choice):
    name = choice.get("extra_body", {}).get("adapter") or choice["model"].rpartition(":")[2]
    text = task_prompts(1, seed=3)[0]
    assert served_tokens(client, text, **choice) == offline_tokens(offline[None if name == NAME else name], text)


def test_concurrent_requests_mixing_adapters_each_equal_offline(client, offline):
    prompts = task_prompts(12, seed=11)
    names = [None, "a", "b"] * 4
    expected = [offline_tokens(offline[n], p) for p, n in zip(prompts, names, strict=True)]
    with ThreadPoolExecutor(12) as pool:
        got = list(pool.map(lambda i: served_tokens(client, prompts[i], model=names[i] or NAME), range(12)))
    assert got == expected
    assert len({tuple(e) for e in expected}) > 3  # the adapters change the answers


def test_anthropic_messages_and_token_counts_take_the_adapter(server, offline):
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    text = task_prompts(1, seed=5)[0]
    answer = client.messages.create(
        model="b", max_tokens=NEW, messages=[{"role": "user", "content": text}], extra_body=GREEDY
    )
    model = offline["b"]
    assert answer.content[0].text == model.tokenizer.decode(greedy(model, chat_tokens(model, text)))
    assert answer.model == "b"
    count = client.messages.count_tokens(model="b", messages=[{"role": "user", "content": text}])
    assert count.input_tokens == len(chat_tokens(model, text))


def test_unknown_or_conflicting_adapters_are_refused(client):
    with pytest.raises(openai.NotFoundError, match="'c' does not exist here; this server serves 'tiny-moe' and its "):
        client.completions.create(model="c", prompt="copy ab >", max_tokens=2)
    with pytest.raises(openai.NotFoundError, match="'tiny-moe:c' does not exist"):
        client.completions.create(model=f"{NAME}:c", prompt="copy ab >", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="names the model 'a' and the adapter 'b'"):
        client.completions.create(model="a", prompt="copy ab >", max_tokens=2, extra_body={"adapter": "b"})
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("c")
