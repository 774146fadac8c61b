"""Output held to a grammar (a JSON Schema, any JSON object, a Lark grammar): the tokens each step may take.

How it works and why: docs/INTERNALS.md, moe_jax/generation/constraint.py.
"""

from __future__ import annotations

import json

import llguidance
import llguidance.numpy
import numpy as np

from moe_jax.errors import InputError

# bounds on one grammar's work: llguidance's defaults, without its state in error messages (they go to clients)
LIMITS = llguidance.LLParserLimits(verbose_errors=False)
DEAD_END_MESSAGE = "this model's vocabulary cannot write what the output grammar needs next"
JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON: no whitespace a sampled model could loop in


def json_schema_grammar(schema) -> str:
    """The grammar of the JSON values `schema` (a JSON Schema object) allows."""
    if not isinstance(schema, dict):
        raise InputError(f"a JSON schema must be an object, got {type(schema).__name__}")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise InputError(f"unusable JSON schema: {e}") from None


def lark_grammar(text: str) -> str:
    """The grammar of a Lark text (llguidance's dialect: https://github.com/guidance-ai/llguidance)."""
    return llguidance.LLMatcher.grammar_from_lark(text)


class GrammarDeadEnd(InputError):
    """A generation reached a point of its grammar that no token of the vocabulary continues."""


class GrammarVocabulary:
    """A tokenizer as llguidance reads it (built once per served model: about a second for a large vocabulary).
    llguidance reads a tokenizer.json whose decoder it knows (byte-level BPE, SentencePiece's); any other (the
    bundled model's characters) is given to it token by token, each token's text as it decodes alone."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        eos = sorted(eos_ids)
        self.vocab_size = vocab_size
        try:
            source = tokenizer.to_json()
            self.tokenizer = llguidance.LLTokenizer(source, n_vocab=vocab_size, eos_token=eos or None)
        except ValueError:  # "can't determine decoder type"
            table = llguidance.TokenizerWrapper(_TokenTable(tokenizer, vocab_size, eos))
            self.tokenizer = llguidance.LLTokenizer(table, n_vocab=vocab_size, eos_token=eos or None)

    def compile(self, grammar: str) -> Constraint:
        """A constraint at the start of `grammar`; an InputError saying what is wrong with a grammar it cannot use."""
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=LIMITS)
        if matcher.is_error():
            raise InputError(f"the output grammar cannot be used: {matcher.get_error()}")
        constraint = Constraint(matcher, self.vocab_size)
        first = np.flatnonzero(constraint.allowed())
        if not any(matcher.validate_tokens([int(t)]) for t in first[:8]):
            raise InputError("this model's vocabulary cannot write the first token of the output grammar")
        return constraint


class _TokenTable:
    """What llguidance.TokenizerWrapper reads of a tokenizer whose tokens each decode to their own text."""

    def __init__(self, tokenizer, vocab_size: int, eos: list[int]):
        self._tokenizer = tokenizer
        self.eos_token_id = eos[0] if eos else None
        self.bos_token_id = None
        known = tokenizer.vocab_size
        self.tokens = [
            tokenizer.decode([i], skip_special_tokens=False).encode() if i < known else b"" for i in range(vocab_size)
        ]
        self.special_token_ids = tokenizer.special_token_ids()

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode_text(text, add_special_tokens=False)


class Constraint:
    """One generation's place in its grammar: which tokens may come next, and each chosen token taken in."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size
        self._bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)

    def copy(self) -> Constraint:
        """An independent constraint at the same place (each choice of a request advances its own)."""
        return Constraint(self.matcher.deep_copy(), self.vocab_size)

    def allowed(self) -> np.ndarray:
        """[vocab] bool: the tokens the grammar allows next (where the vocabulary cannot go on, one token that
        `advance` then refuses)."""
        llguidance.numpy.fill_next_token_bitmask(self.matcher, self._bitmask, 0)
        return np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[: self.vocab_size].astype(bool)

    def masked(self, logits: np.ndarray) -> np.ndarray:
        """`logits` with every token the grammar does not allow next at -inf."""
        return np.where(self.allowed(), logits, np.float32(-np.inf)).astype(np.float32, copy=False)

    def advance(self, token: int):
        """Takes in the chosen token; GrammarDeadEnd where it cannot be (the vocabulary cannot write what the
        grammar needs next)."""
        if not self.matcher.consume_token(token):
            raise GrammarDeadEnd(DEAD_END_MESSAGE)

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more."""
        return self.matcher.is_stopped()


def schema_of_response_format(response_format) -> str | None:
    """The grammar an OpenAI `response_format` asks for: None for text, any JSON object for `json_object`, the
    schema's values for `json_schema`; an InputError naming what is wrong otherwise."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise InputError('response_format must be an object such as {"type": "json_object"}')
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar({"type": "object"})
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise InputError('response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}')
        return json_schema_grammar(spec["schema"])
    raise InputError(f"response_format type {json.dumps(kind)[:60]}: choose text, json_object or json_schema")
