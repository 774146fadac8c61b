"""GGUF files (llama.cpp's format): every family read from a file laid out as llama.cpp's converter writes it gives
transformers' logits; quantized types give the logits of their dequantized weights; Q4_0 experts convert to int4
bit for bit; the tokenizer comes back from the metadata; transformers' own GGUF reader agrees with the test files'
layout; llama.cpp's converter's files load too where a llama.cpp tree is at hand."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

import moe_jax
from host_kernels import ExpertStore
from moe_jax.convert import convert
from moe_jax.convert import main as convert_main
from moe_jax.errors import CheckpointError
from moe_jax.formats.tokenizer import load_tokenizer
from tests.gguf_files import Q, dequantize, dequantized_model, quantize_q6_k, write_gguf
from tests.hf_models import FAMILY_VARIANTS, hf_logits, make_hf_model, save_hf_model

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# DeepSeek's YaRN: a GGUF file holds one mscale (llama.cpp's yarn_log_multiplier), as every release's config has
# mscale == mscale_all_dim; the tiny test config's differ, so the file's test sets them equal
EQUAL_MSCALE = dict(
    rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64, mscale=0.707,
        mscale_all_dim=0.707, beta_fast=32, beta_slow=1,
    )
)  # fmt: skip
FAMILIES = {
    "mixtral": {},
    "qwen2_moe": {},
    "qwen3_moe": {},
    "olmoe": {},
    "glm4_moe": {},
    "minimax_m2": {},
    "gpt_oss": dict(  # what a GGUF file can say: llama.cpp fixes the clamp at 7 and truncates YaRN's ramp
        swiglu_limit=7.0,
        rope_parameters={**FAMILY_VARIANTS["gpt_oss"][1]["rope_parameters"], "truncate": True},
    ),
    "deepseek_v2": {},
    "deepseek_v2_q_lora": {},
    "deepseek_v3": EQUAL_MSCALE,
    "deepseek_v32": dict(mlp_layer_types=["dense", "sparse", "sparse"], first_k_dense_replace=1),  # leading dense
    "qwen3_next": {},
    "qwen3_5_moe": {},
}
IDS = np.random.default_rng(1).integers(0, 96, size=(3, 13))


def logits(path, **kwargs):
    return moe_jax.load_model(path, backend=kwargs.pop("backend", "device"), **kwargs).logits(IDS)


@pytest.mark.parametrize("variant", sorted(FAMILIES))
def test_every_family_gives_transformers_logits(variant, tmp_path):
    hf = make_hf_model(variant, **FAMILIES[variant])
    path = write_gguf(hf, tmp_path / "model.gguf")
    np.testing.assert_allclose(logits(path), hf_logits(hf, IDS), atol=1e-4, rtol=0)


# (family, overrides making every quantized row a whole number of blocks, GGML type)
QUANTIZED = {
    "Q8_0": ("qwen3_moe", dict(moe_intermediate_size=32)),
    "Q4_0": ("mixtral", dict(intermediate_size=64)),
    # K-quants' blocks are 256 wide
    "Q6_K": (
        "qwen3_moe",
        dict(hidden_size=256, head_dim=64, moe_intermediate_size=256, num_experts=4, num_experts_per_tok=2),
    ),
}


@pytest.mark.parametrize("qtype", sorted(QUANTIZED))
def test_quantized_types_give_their_dequantized_weights_logits(qtype, tmp_path):
    family, overrides = QUANTIZED[qtype]
    hf = make_hf_model(family, **overrides)
    path = write_gguf(hf, tmp_path / "model.gguf", dense=qtype)
    reference = hf_logits(dequantized_model(hf, dense=qtype), IDS)
    # float32: the dequantized values exactly (the default for a quantized file is bfloat16)
    np.testing.assert_allclose(logits(path, dtype="float32"), reference, atol=1e-4, rtol=0)
    assert np.abs(reference - hf_logits(hf, IDS)).max() > 1e-3  # the quantization is really there


def test_q6_k_writer_is_the_gguf_packages_inverse():
    w = np.random.default_rng(0).normal(size=(4, 512)).astype(np.float32)
    back = gguf.quants.dequantize(quantize_q6_k(w), Q.Q6_K).reshape(w.shape)
    step = np.abs(w).reshape(4, 2, 16, 16).max(axis=-1) / 31  # each 16-value sub-block's step, before rounding
    assert (np.abs(back - w).reshape(4, 2, 16, 16) <= step[..., None] * 0.6).all()


def _store_experts(out: Path, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """A converted int4 store's layer as float [e, d, 2f] / [e, f, d], unpacked."""
    stored = ExpertStore.open(out / "experts")[layer]
    fmt, d, f = stored.format, stored.hidden, stored.ffn
    fp = stored.w13_packed.shape[1] * 16 // 2  # ffn padded to the packed column blocks
    w13 = np.stack([fmt.unpack(fmt.wrap(p, d, 2 * fp)) for p in stored.w13_packed])
    w2 = np.stack([fmt.unpack(fmt.wrap(p, f, d)) for p in stored.w2_packed])
    return np.concatenate([w13[..., :f], w13[..., fp : fp + f]], axis=-1), w2


def test_q4_0_experts_convert_to_int4_value_for_value(tmp_path):
    hf = make_hf_model("qwen3_moe", moe_intermediate_size=32)
    path = write_gguf(hf, tmp_path / "model.gguf", dense="F32", experts="Q4_0")
    out = convert(path, tmp_path / "converted", progress=False)
    manifest = json.loads((out / "experts" / "manifest.json").read_text())
    assert manifest["quant"] == "int4"
    for layer in range(hf.config.num_hidden_layers):
        w13, w2 = _store_experts(out, layer)
        experts = hf.model.layers[layer].mlp.experts
        gate_up = dequantize(experts.gate_up_proj.detach().numpy(), Q.Q4_0)
        np.testing.assert_array_equal(w13, gate_up.transpose(0, 2, 1))
        np.testing.assert_array_equal(w2, dequantize(experts.down_proj.detach().numpy(), Q.Q4_0).transpose(0, 2, 1))
    # loading the file with quant="int4" repacks them the same way (in either dtype the rows take)
    for dtype in ("float32", "bfloat16"):
        at_load = logits(path, backend="host", quant="int4", dtype=dtype)
        np.testing.assert_array_equal(logits(out, backend="host", dtype=dtype), at_load)
    converted = logits(out, backend="host", dtype="float32")  # (its own dtype is bfloat16, the store's)
    reference = hf_logits(dequantized_model(hf, experts="Q4_0"), IDS)
    assert np.abs(converted - reference).max() < 0.1  # the int4 kernels quantize their activations to int8


def test_a_quantized_file_loads_and_converts_as_llama_cpp_holds_it(tmp_path):
    """Q8_0 dense weights and Q4_0 experts: a direct load keeps the experts int4 (about the file's own size in RAM,
    not bfloat16's 3.5x), and convert stores the dense weights in the model's bfloat16 (what the file holds as F32,
    the norms here, in float32): the converted model computes the direct load's logits bit for bit."""
    from moe_jax.formats.safetensors_io import SafetensorsFile

    hf = make_hf_model("qwen3_moe", moe_intermediate_size=32)
    path = write_gguf(hf, tmp_path / "model.gguf", dense="Q8_0", experts="Q4_0")
    direct = moe_jax.load_model(path, backend="host")
    assert (direct.dtype, direct.plan.quant) == ("bfloat16", "int4")
    out = convert(path, tmp_path / "converted", progress=False)
    dense = SafetensorsFile(out / "model.safetensors")
    codes = {name: dense.dtype_code(name) for name in dense.keys()}
    assert codes["model.layers.0.self_attn.q_proj.weight"] == codes["model.embed_tokens.weight"] == "BF16"
    assert codes["model.layers.0.input_layernorm.weight"] == codes["model.layers.0.self_attn.q_norm.weight"] == "F32"
    np.testing.assert_array_equal(moe_jax.load_model(out, backend="host").logits(IDS), direct.logits(IDS))


def test_q8_0_experts_convert_to_int8_within_its_error(tmp_path):
    """Q8_0's scale per 32 weights does not fit int8's one per output column: requantized, said so, close."""
    hf = make_hf_model("qwen3_moe", moe_intermediate_size=32)
    path = write_gguf(hf, tmp_path / "model.gguf", dense="F32", experts="Q8_0")
    out = convert(path, tmp_path / "converted", progress=False)
    assert json.loads((out / "experts" / "manifest.json").read_text())["quant"] == "int8"
    reference = hf_logits(dequantized_model(hf, experts="Q8_0"), IDS)
    assert np.abs(logits(out, backend="host", dtype="float32") - reference).max() < 0.05


def test_convert_cli_writes_config_tokenizer_and_float_experts_on_request(tmp_path, capsys):
    hf = make_hf_model("qwen2_moe")
    path = write_gguf(hf, tmp_path / "model.gguf", tokenizer=_tokenizer_metadata(_bpe_tokenizer()))
    convert_main(["--gguf", str(path), "--out", str(tmp_path / "out"), "--quant", "none"])
    assert "converted" in capsys.readouterr().out
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "qwen2_moe" and config["shared_expert_intermediate_size"] == 36
    assert (tmp_path / "out" / "tokenizer.json").exists()
    np.testing.assert_allclose(logits(tmp_path / "out"), hf_logits(hf, IDS), atol=1e-4, rtol=0)


def _bpe_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from moe_jax.formats.gguf_tokenizer import PRE_TOKENIZER_SPLITS

    tokenizer = Tokenizer(models.BPE())
    split = pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLITS["qwen2"][0]), behavior="isolated")
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    text = ["The quick brown fox jumps over the lazy dog. It's 2026, and 1234 tokens don't merge themselves!"] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=90,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(text, trainer)
    return tokenizer


TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def _tokenizer_metadata(tokenizer) -> dict:
    """What llama.cpp's converter writes for a byte-level BPE tokenizer (qwen2 pre-tokenizer)."""
    data = json.loads(tokenizer.to_str())
    vocab = data["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in data["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if t in special else 1 for t in tokens],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": vocab["<|im_end|>"],
        "tokenizer.ggml.padding_token_id": vocab["<|endoftext|>"],
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": TEMPLATE,
    }


def test_a_file_without_an_eos_id_ends_at_its_end_of_text_token_and_says_so(tmp_path):
    original = _bpe_tokenizer()
    metadata = _tokenizer_metadata(original)
    del metadata["tokenizer.ggml.eos_token_id"]
    path = write_gguf(make_hf_model("qwen3_moe"), tmp_path / "model.gguf", tokenizer=metadata)
    with pytest.warns(UserWarning, match="no tokenizer.ggml.eos_token_id; generation ends at .*'<|im_end|>'"):
        model = moe_jax.load_model(path)
    im_end = original.token_to_id("<|im_end|>")
    assert model.config.eos_token_ids == (im_end,) and model.tokenizer.eos_token == "<|im_end|>"
    metadata["tokenizer.ggml.tokens"] = [t.replace("<|im_end|>", "<|x|>") for t in metadata["tokenizer.ggml.tokens"]]
    metadata["tokenizer.ggml.tokens"] = [t.replace("<|endoftext|>", "<|y|>") for t in metadata["tokenizer.ggml.tokens"]]
    path = write_gguf(make_hf_model("qwen3_moe"), tmp_path / "none.gguf", tokenizer=metadata)
    with pytest.warns(UserWarning, match="no end-of-text token in its vocabulary: generation runs to its token limit"):
        assert moe_jax.load_model(path).config.eos_token_ids == ()


def test_tokenizer_and_chat_template_come_back_from_the_metadata(tmp_path):
    original = _bpe_tokenizer()
    hf = make_hf_model("qwen3_moe")
    path = write_gguf(hf, tmp_path / "model.gguf", tokenizer=_tokenizer_metadata(original))
    tokenizer = load_tokenizer(path)
    texts = [
        "The quick brown fox, isn't it?",
        "  spaces\n\nand newlines 12345 don't",
        "<|im_start|>user\nhello<|im_end|>",
        "ünïcødé bytes → fall back",
    ]
    for text in texts:
        assert tokenizer.encode(text) == original.encode(text).ids, text
        assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text
    assert tokenizer.chat_template == TEMPLATE
    assert tokenizer.eos_token == "<|im_end|>" and not tokenizer.add_bos
    assert set(tokenizer.template_special_tokens()) == {"<|im_start|>", "<|im_end|>"}
    broken = {**_tokenizer_metadata(original), "tokenizer.ggml.merges": ["no such"]}
    with pytest.raises(CheckpointError, match="broken.gguf: its tokenizer metadata does not make a tokenizer"):
        load_tokenizer(write_gguf(hf, tmp_path / "broken.gguf", tokenizer=broken))
    unknown = {**_tokenizer_metadata(original), "tokenizer.ggml.pre": "made-up"}
    with pytest.raises(CheckpointError, match="tokenizer.ggml.pre 'made-up' is not one moe_jax reproduces"):
        load_tokenizer(write_gguf(hf, tmp_path / "unknown.gguf", tokenizer=unknown))


@pytest.mark.parametrize("variant", ["qwen2_moe", "qwen3_moe"])
def test_transformers_reads_the_test_files_as_the_original_model(variant, tmp_path):
    """The test files' tensor layout checked by an independent reader: transformers' GGUF loader (it knows these two
    families' tensors; of their metadata it reads too little for the tiny sizes, so it is given the config)."""
    hf = make_hf_model(variant)
    write_gguf(hf, tmp_path / "model.gguf", tokenizer=_tokenizer_metadata(_bpe_tokenizer()))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="model.gguf", config=hf.config, dtype=torch.float32
    ).eval()
    np.testing.assert_allclose(hf_logits(loaded, IDS), hf_logits(hf, IDS), atol=1e-4, rtol=0)


def _bare_gguf(path: Path, arch: str, numbers: dict[str, int | str], tensors: dict[str, np.ndarray]) -> Path:
    """A GGUF file holding only the given metadata (`{arch}.KEY`) and tensors."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in numbers.items():
        (writer.add_string if isinstance(value, str) else writer.add_uint32)(f"{arch}.{key}", value)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    return path


def test_a_gguf_file_moe_jax_cannot_run_is_refused_by_name(tmp_path):
    embeddings = {"token_embd.weight": np.zeros((8, 4), np.float32)}
    dense = _bare_gguf(tmp_path / "dense.gguf", "llama", {"block_count": 1}, embeddings)
    with pytest.raises(CheckpointError, match=r"dense.gguf: GGUF architecture 'llama' without experts"):
        moe_jax.load_model(dense)
    old = _bare_gguf(
        tmp_path / "old.gguf",
        "llama",
        {"expert_count": 2},
        {"blk.0.ffn_gate.1.weight": embeddings["token_embd.weight"]},
    )
    with pytest.raises(CheckpointError, match=r"old.gguf: experts stored one tensor each .* current llama.cpp"):
        moe_jax.load_model(old)
    typed = _bare_gguf(tmp_path / "typed.gguf", "qwen3moe", {"block_count": "two"}, {})
    with pytest.raises(CheckpointError, match=r"typed.gguf: unreadable GGUF metadata"):
        moe_jax.load_model(typed)
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 20)
    with pytest.raises(CheckpointError, match="broken.gguf: not a readable GGUF file"):
        moe_jax.load_model(broken)
    with pytest.raises(CheckpointError, match="missing.gguf: no such GGUF file"):
        moe_jax.load_model(tmp_path / "missing.gguf")


LLAMA_CPP = os.environ.get("LLAMA_CPP_DIR")
# the tiny configs' values that no release has and llama.cpp's converter does not carry over: DeepSeek's
# num_key_value_heads below the head count (it splits kv_b by it), V3 and MiniMax-M2 without `scoring_func` (it
# writes the gating function from it; llama.cpp reads a file without one as softmax), OLMoE's clip_qkv and an
# rms_norm_eps other than 1e-5 (it writes 1e-5 for every OLMoE)
AS_RELEASED = {
    "deepseek_v2": dict(num_key_value_heads=4),
    "deepseek_v2_q_lora": dict(num_key_value_heads=4),
    "deepseek_v3": dict(num_key_value_heads=4, scoring_func="sigmoid"),
    "deepseek_v32": dict(scoring_func="sigmoid"),
    "minimax_m2": dict(scoring_func="sigmoid"),
    "olmoe": dict(clip_qkv=None, rms_norm_eps=1e-5),
}


@pytest.mark.skipif(not LLAMA_CPP, reason="LLAMA_CPP_DIR (a llama.cpp source tree, for its converter) is not set")
@pytest.mark.parametrize("variant", sorted(FAMILIES))
def test_llama_cpps_converter_files_give_transformers_logits(variant, tmp_path):
    """Files written by llama.cpp's own convert_hf_to_gguf.py (needs `sentencepiece` for the small tokenizer it is
    given); skipped without a llama.cpp tree (see bench/vs_llamacpp.py for getting one)."""
    pytest.importorskip("sentencepiece")
    from bench.vs_llamacpp import convert_with_llama_cpp, with_tokenizer

    overrides = dict(vocab_size=256, **FAMILIES[variant], **AS_RELEASED.get(variant, {}))  # 256: for its tokenizer
    hf = make_hf_model(variant, **overrides)
    source = with_tokenizer(save_hf_model(hf, tmp_path / "hf"))
    out = tmp_path / "model.gguf"
    convert_with_llama_cpp(Path(LLAMA_CPP) / "convert_hf_to_gguf.py", source, "f32", out, quiet=True)
    np.testing.assert_allclose(logits(out), hf_logits(hf, IDS), atol=1e-4, rtol=0)


def test_infer_generates_from_a_gguf_file_with_its_tokenizer_and_template(tmp_path):
    """infer.py --model FILE.gguf: tokenizer and chat template from the file, greedy tokens equal to generating with
    the converted directory's."""
    import infer as infer_cli

    tokenizer = _bpe_tokenizer()
    hf = make_hf_model("qwen3_moe", vocab_size=tokenizer.get_vocab_size())
    path = write_gguf(hf, tmp_path / "model.gguf", tokenizer=_tokenizer_metadata(tokenizer))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "The quick brown fox"})
        + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "hi"}]})
        + "\n"
    )
    convert(path, tmp_path / "converted", progress=False, quant=None)
    outputs = {}
    for name, model in (("gguf", path), ("converted", tmp_path / "converted")):
        out = tmp_path / f"{name}.jsonl"
        args = ["--model", model, "--prompts", prompts, "--out", out, "--max-new-tokens", "5", "--temperature", "0"]
        assert infer_cli.main([str(a) for a in args]) in (None, 0)
        records = [json.loads(line) for line in out.read_text().splitlines()]
        outputs[name] = [{k: v for k, v in r.items() if k != "seconds"} for r in records]
    assert len(outputs["gguf"]) == 2 and outputs["gguf"] == outputs["converted"]


def test_sentencepiece_vocabularies_tokenize_as_sentencepiece_does(tmp_path):
    """A "llama" (SentencePiece) vocabulary as llama.cpp's converter writes it (pieces, scores, types: normal,
    unknown, control, byte) tokenizes as the SentencePiece model it came from, byte fallback included."""
    spm = pytest.importorskip("sentencepiece")
    text = tmp_path / "text.txt"
    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefghijklmnop"), size=rng.integers(2, 8))) for _ in range(2000)]
    text.write_text("\n".join(" ".join(words[i : i + 10]) for i in range(0, len(words), 10)))
    spm.SentencePieceTrainer.train(  # normalised as Llama's and Mistral's are: not at all (spaces kept)
        input=str(text),
        model_prefix=str(tmp_path / "sp"),
        vocab_size=300,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
    )
    processor = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    pieces = [processor.id_to_piece(i) for i in range(processor.vocab_size())]

    def kind(i):  # llama.cpp's SentencePieceTokenTypes
        if processor.is_unknown(i):
            return 2
        if processor.is_control(i):
            return 3
        return 6 if processor.is_byte(i) else 1

    metadata = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": pieces,
        "tokenizer.ggml.scores": [processor.get_score(i) for i in range(len(pieces))],
        "tokenizer.ggml.token_type": [kind(i) for i in range(len(pieces))],
        "tokenizer.ggml.bos_token_id": processor.bos_id(),
        "tokenizer.ggml.eos_token_id": processor.eos_id(),
        "tokenizer.ggml.unknown_token_id": processor.unk_id(),
    }
    hf = make_hf_model("mixtral", vocab_size=len(pieces))
    tokenizer = load_tokenizer(write_gguf(hf, tmp_path / "model.gguf", tokenizer=metadata))
    for sample in ["abc defg hij", "  two  spaces", "unseen QRSTUV ünï", words[7] + " " + words[8]]:
        assert tokenizer.encode(sample, add_special_tokens=False) == processor.encode(sample), sample
        assert tokenizer.decode(processor.encode(sample)) == processor.decode(processor.encode(sample))
    assert tokenizer.encode("abc")[0] == processor.bos_id()  # llama vocabularies add BOS
