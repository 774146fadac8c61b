"""The checkpoint's tokenizer (`tokenizer.json` via the `tokenizers` library) and its chat template, if any."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from moe_jax.errors import CheckpointError, InputError, read_json_file
from moe_jax.formats.gguf_checkpoint import GGUFFile, is_gguf_file
from moe_jax.formats.gguf_tokenizer import tokenizer_files


class Tokenizer:
    def __init__(self, path: Path, gguf_files: dict[str, str] | None = None):
        """The tokenizer of a checkpoint directory (tokenizer.json, tokenizer_config.json) or a .gguf file (from its
        metadata; `gguf_files`: gguf_tokenizer.tokenizer_files of it, when already made)."""
        self.path = Path(path)
        if is_gguf_file(self.path):
            files = gguf_files or tokenizer_files(GGUFFile(self.path))
            if files is None:
                raise CheckpointError(f"{self.path}: the GGUF file holds no tokenizer")
            self._tok = HFTokenizer.from_str(files["tokenizer.json"])
            settings = json.loads(files["tokenizer_config.json"])
        else:
            try:
                self._tok = HFTokenizer.from_file(str(self.path / "tokenizer.json"))
            except Exception as e:  # the tokenizers library raises bare Exceptions on parse errors
                raise CheckpointError(f"{self.path / 'tokenizer.json'}: unreadable tokenizer ({e})") from e
            settings = {}
            config_file = self.path / "tokenizer_config.json"
            if config_file.exists():
                settings = read_json_file(config_file, "a tokenizer directory")
        self.chat_template = settings.get("chat_template")
        self.bos_token = _token_text(settings.get("bos_token"))
        self.eos_token = _token_text(settings.get("eos_token"))
        self.add_bos = bool(settings.get("add_bos_token", False))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, special-token strings in it read as those tokens (a prompt file's own markup)."""
        return self._with_bos(_encoded(self._tok, text, add_special_tokens).ids, add_special_tokens)

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` as plain text: a special-token string in it (`</s>`, `<|im_end|>`) is its characters,
        never the control token, so text from a client cannot end a turn or forge one. `add_special_tokens`: the
        tokenizer's own BOS/EOS additions, as in `encode`."""
        ids = _encoded(self._text_tokenizer, text, add_special_tokens).ids
        return self._with_bos(ids, add_special_tokens)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of `text` (special-token strings read as tokens, nothing added) and each one's character span."""
        encoding = _encoded(self._tok, text, False)
        return encoding.ids, encoding.offsets

    def _with_bos(self, ids: list[int], add_special_tokens: bool) -> list[int]:
        bos = self.token_to_id(self.bos_token) if self.bos_token else None
        if add_special_tokens and self.add_bos and bos is not None and ids[:1] != [bos]:
            ids = [bos, *ids]  # tokenizer.json without a post-processor: tokenizer_config asks for BOS
        return ids

    @functools.cached_property
    def _text_tokenizer(self) -> HFTokenizer:
        """A copy that does not split special-token strings out of its input (a flag on the object: a copy keeps
        `encode` as it is for every other thread)."""
        tok = HFTokenizer.from_str(self._tok.to_str())
        tok.encode_special_tokens = True
        return tok

    @functools.cached_property
    def special_strings(self) -> tuple[str, ...]:
        """The special tokens' texts, longest first."""
        added = self._tok.get_added_tokens_decoder().values()
        return tuple(sorted({t.content for t in added if t.special}, key=len, reverse=True))

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json holds it."""
        return self._tok.to_str()

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def vocabulary(self) -> list[str]:
        """Every token's entry (added tokens included), as the tokenizer spells it."""
        return list(self._tok.get_vocab(with_added_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def special_token_ids(self) -> list[int]:
        return [i for i, t in self._tok.get_added_tokens_decoder().items() if t.special]

    def template_special_tokens(self) -> list[str]:
        """Special tokens that the chat template writes (message, tool and thinking delimiters): the natural
        anchor points of a conversation. BOS is left out: every prompt starts with it."""
        if not self.chat_template:
            return []
        added = [t.content for t in self._tok.get_added_tokens_decoder().values() if t.special]
        return [t for t in added if t in self.chat_template and t != self.bos_token]


def _encoded(tokenizer: HFTokenizer, text: str, add_special_tokens: bool):
    """`tokenizer.encode`, with text that is not Unicode (a lone surrogate, which JSON's `\\ud800` makes) an
    InputError naming where, rather than the library's TypeError."""
    try:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except TypeError:
        if isinstance(text, str):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise InputError(
                    f"the text holds a lone surrogate (U+{ord(text[e.start]):04X}) at character {e.start}: "
                    "it is not Unicode text"
                ) from None
        raise


def _token_text(value):
    if isinstance(value, dict):  # older configs store AddedToken dicts
        return value.get("content")
    return value


def load_tokenizer(path: Path, gguf_file: GGUFFile | None = None) -> Tokenizer | None:
    """The tokenizer of a checkpoint directory or .gguf file (`gguf_file`: that file already opened, whose metadata
    is not read again); None when it has none."""
    if is_gguf_file(path):
        files = tokenizer_files(gguf_file or GGUFFile(path))
        return Tokenizer(path, files) if files is not None else None
    return Tokenizer(path) if (Path(path) / "tokenizer.json").is_file() else None
