"""A GGUF file's tokenizer as `tokenizer.json` / `tokenizer_config.json` (the `tokenizers` library's format), from
its `tokenizer.ggml.*` metadata.

Byte-level BPE vocabularies (`tokenizer.ggml.model` "gpt2": Qwen, DeepSeek-V3, GLM, OLMoE) keep their tokens and
merges; the pre-tokenizer's split pattern is llama.cpp's for the file's `tokenizer.ggml.pre` (PRE_TOKENIZER_SPLITS).
SentencePiece vocabularies ("llama": Mixtral) become a BPE with byte fallback whose merges are ranked by the
tokens' scores, which is how transformers converts a SentencePiece model. Token types 3 (control) and 4
(user-defined) are added tokens, special when control; the chat template and BOS/EOS/padding tokens go into
tokenizer_config.json.
"""

from __future__ import annotations

import json

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from moe_jax.errors import CheckpointError
from moe_jax.formats.gguf_config import end_of_text_token

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# tokenizer.ggml.pre -> the split patterns applied in turn before byte-level encoding (llama.cpp's llama-vocab.cpp)
PRE_TOKENIZER_SPLITS = {
    "default": [_GPT2],
    "gpt-2": [_GPT2],
    "olmo": [_GPT2],
    "qwen2": [_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "llama3": [_LLAMA3],
    "llama-bpe": [_LLAMA3],
    "glm4": [_LLAMA3],
    "deepseek-v3": [
        r"\p{N}{1,3}",
        r"[一-龥぀-ゟ゠-ヿ]+",
        r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|"
        r"\s*[\r\n]+|\s+(?!\S)|\s+",
    ],
}
_CONTROL, _USER_DEFINED = 3, 4


def tokenizer_files(file) -> dict[str, str] | None:
    """{"tokenizer.json": ..., "tokenizer_config.json": ...} for a gguf_checkpoint.GGUFFile, or None when the file
    has no tokenizer. A vocabulary type or pre-tokenizer moe_jax cannot reproduce is a CheckpointError naming it."""
    kind = file.field("tokenizer.ggml.model")
    if kind is None:
        return None
    tokens = list(file.field("tokenizer.ggml.tokens") or [])
    types = list(file.field("tokenizer.ggml.token_type") or [1] * len(tokens))
    if kind not in ("gpt2", "llama"):
        raise CheckpointError(f"{file.path}: tokenizer.ggml.model {kind!r} is not supported (gpt2 or llama)")
    try:
        tokenizer = _byte_level_bpe(file, tokens) if kind == "gpt2" else _sentencepiece_bpe(file, tokens)
    except CheckpointError:
        raise
    except Exception as e:  # the tokenizers library raises bare Exceptions (a merge of unknown tokens, ...)
        raise CheckpointError(f"{file.path}: its tokenizer metadata does not make a tokenizer ({e})") from None
    user_defined = [i for i, t in enumerate(types) if t == _USER_DEFINED]
    tokenizer.add_tokens([AddedToken(tokens[i], normalized=False) for i in user_defined])
    control = [i for i, t in enumerate(types) if t == _CONTROL]
    tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in control])
    settings = {"add_bos_token": bool(file.field("tokenizer.ggml.add_bos_token", kind == "llama"))}
    for key, name in (("bos", "bos_token"), ("eos", "eos_token"), ("padding", "pad_token"), ("unknown", "unk_token")):
        token_id = file.field(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            settings[name] = tokens[int(token_id)]
    if "eos_token" not in settings and (eos := end_of_text_token(file)) is not None:
        settings["eos_token"] = eos[1]  # as the config resolves it (gguf_config, which warns)
    template = file.field("tokenizer.chat_template")
    if template:
        settings["chat_template"] = template
    return {"tokenizer.json": tokenizer.to_str(pretty=True), "tokenizer_config.json": json.dumps(settings, indent=2)}


def _byte_level_bpe(file, tokens: list[str]) -> Tokenizer:
    pre = file.field("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_SPLITS:
        raise CheckpointError(
            f"{file.path}: tokenizer.ggml.pre {pre!r} is not one moe_jax reproduces; supported: "
            f"{', '.join(PRE_TOKENIZER_SPLITS)}"
        )
    merges = [tuple(m.split(" ", 1)) for m in file.field("tokenizer.ggml.merges") or []]
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab, merges, ignore_merges=pre in ("llama3", "llama-bpe", "glm4")))
    splits = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in PRE_TOKENIZER_SPLITS[pre]]
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(file, tokens: list[str]) -> Tokenizer:
    scores = list(file.field("tokenizer.ggml.scores") or [0.0] * len(tokens))
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = []
    for token, i in vocab.items():  # every split of a token into two tokens is a merge, ranked by its score
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                merges.append((scores[i], vocab[left], vocab[right], left, right))
    merges.sort(key=lambda m: (-m[0], m[1], m[2]))
    unk_id = file.field("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None else None
    model = models.BPE(vocab, [(m[3], m[4]) for m in merges], unk_token=unk, fuse_unk=True, byte_fallback=True)
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return tokenizer
