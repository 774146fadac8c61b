"""Output held to a grammar through the official openai SDK: `response_format` (json_object, json_schema) and
vLLM's `grammar`, on a tiny random model with a byte-level vocabulary (every JSON character a token), greedy and
sampled; and the clear 400s for grammars a request or the vocabulary cannot use."""

from __future__ import annotations

import json

import jsonschema
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from moe_jax.formats.tokenizer import Tokenizer  # noqa: E402
from moe_jax.serving.process import running_server  # noqa: E402
from tests.hf_models import make_hf_model, save_hf_model  # noqa: E402
from tests.test_chat_injection import byte_level  # noqa: E402
from tests.test_serve import MODEL, NAME  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_end|>", "<|im_start|>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "maxItems": 3},
        "kind": {"enum": ["x", "y", "zz"]},
    },
    "required": ["name", "count", "ok", "tags", "kind"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured")
    model_dir = save_hf_model(make_hf_model("qwen3_moe", vocab_size=272, max_position_embeddings=512), root / "m")
    byte_level(SPECIALS).save(str(model_dir / "tokenizer.json"))
    settings = {"chat_template": TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(settings))
    config = json.loads((model_dir / "config.json").read_text())
    config["eos_token_id"] = 257  # <|im_end|>: after the 256 byte tokens and <|endoftext|>
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


@pytest.fixture(scope="module")
def client(model_dir):
    with running_server(["--model", str(model_dir), "--served-model-name", NAME], model_dir / "server.log") as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def ask(client, **kwargs):
    messages = [{"role": "user", "content": "Describe a thing as JSON."}]
    return client.chat.completions.create(model=NAME, messages=messages, max_tokens=200, **kwargs)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_json_schema_answer_parses_and_validates(client, temperature):
    response_format = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    answer = ask(client, response_format=response_format, temperature=temperature, seed=3, n=4)
    for choice in answer.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    if temperature:
        assert len({c.message.content for c in answer.choices}) > 1  # sampled apart, each within the schema
    streamed = ask(client, response_format=response_format, temperature=temperature, seed=3, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == answer.choices[0].message.content


def test_json_object_and_a_lark_grammar(client, model_dir):
    """Any JSON object: a random model's strings would run past max_tokens (most bytes continue a string), so a
    logit bias makes closing quotes and braces likelier; which tokens are allowed stays the grammar's."""
    tokenizer = Tokenizer(model_dir)
    closing = {str(tokenizer.token_to_id(c)): 6 for c in '"}'}
    for seed in range(3):
        answer = ask(client, response_format={"type": "json_object"}, temperature=1.0, seed=seed, logit_bias=closing)
        assert answer.choices[0].finish_reason == "stop", answer.choices[0]
        assert isinstance(json.loads(answer.choices[0].message.content), dict)
    words = client.completions.create(
        model=NAME,
        prompt="Say yes or no:",
        max_tokens=20,
        temperature=1.0,
        seed=1,
        extra_body={"grammar": 'start: "yes" | "no"'},
    )
    assert words.choices[0].text in ("yes", "no") and words.choices[0].finish_reason == "stop"


def test_unusable_grammars_are_400s(client):
    with pytest.raises(openai.BadRequestError, match="response_format type"):
        ask(client, response_format={"type": "xml"})
    with pytest.raises(openai.BadRequestError, match="not both"):
        ask(client, response_format={"type": "json_object"}, extra_body={"grammar": 'start: "a"'})
    with pytest.raises(openai.BadRequestError, match="output grammar cannot be used"):
        ask(client, extra_body={"grammar": "start: undefined_rule"})
    with pytest.raises(openai.BadRequestError, match="json_schema needs"):
        ask(client, response_format={"type": "json_schema", "json_schema": {"name": "x"}})


def test_a_vocabulary_that_cannot_write_the_grammar_is_told_so(bundled_server):
    """The bundled model's characters hold no `@`: a grammar that starts with one is refused before generating,
    one that needs it later ends its request with a 400 and leaves the server serving."""
    client = openai.OpenAI(base_url=bundled_server.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "copy ab >"}]
    with pytest.raises(openai.BadRequestError, match="cannot write the first token"):
        client.chat.completions.create(model=NAME, messages=messages, extra_body={"grammar": 'start: "@" "a"'})
    with pytest.raises(openai.BadRequestError, match="after 1 tokens, this model's vocabulary cannot write"):
        client.completions.create(
            model=NAME, prompt="copy ab >", max_tokens=5, extra_body={"grammar": 'start: "a" "@"'}
        )
    answer = client.completions.create(
        model=NAME, prompt="copy ab >", max_tokens=5, temperature=0, extra_body={"grammar": 'start: "ab"'}
    )
    assert answer.choices[0].text == "ab" and answer.choices[0].finish_reason == "stop"
    assert MODEL.exists()
