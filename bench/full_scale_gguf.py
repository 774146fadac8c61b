"""A whole model of a real model's config with random weights, written straight into a Q4_0 GGUF file with the
`gguf` package: the file llama-quantize's Q4_0 would make of the release (experts, attention and embeddings Q4_0,
the head Q6_K, norms and the router float32), without the release's bfloat16 weights (61 GB for Qwen3-30B-A3B)
ever existing. The blocks are random codes under random scales: every engine reads the same bytes, and the model's
activations stay in range (sampled tokens route as text does, see bench/full_scale.py).

    python bench/full_scale_gguf.py --shape qwen3-30b-a3b --out /tmp/qwen3-30b-a3b-q4_0.gguf
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NamedTuple

import gguf
import numpy as np
from tqdm import tqdm

Q = gguf.GGMLQuantizationType
WEIGHT_STD = 0.02  # what a random initialisation gives a real model's products
# Random layers must not pull every position's hidden state towards one direction, or the routers send every token
# to the same few experts, which no text does (and which flatters every engine: fewer experts' bytes read). Attention
# averages its values over positions, so what the positions share passes through each layer's o.v product, whose
# gain at WEIGHT_STD is about 1: it compounds over 48 layers, and by the fourth layer a quarter of the experts got
# every token. So the products that write into the residual stream (attention's output, the experts' down) are
# scaled by 1 / sqrt(2 x layers), as GPT-2's initialisation scales them, and the embedding is large against what
# the layers add: every layer's router then sees the token itself.
EMBED_STD = 1.0


class FullShape(NamedTuple):
    """A released model's config, whole (every layer, the full vocabulary), for the families written here."""

    arch: str  # GGUF architecture
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    experts_used: int
    expert_ffn: int
    dense_ffn: int  # the config's intermediate_size (its dense MLP's, unused by an all-MoE model)
    context: int
    rope_theta: float
    rms_eps: float


FULL_SHAPES = {
    # Qwen/Qwen3-30B-A3B's config.json: 48 layers of 128 experts, an untied head over 151,936 tokens
    "qwen3-30b-a3b": FullShape(
        arch="qwen3moe",
        vocab=151936,
        hidden=2048,
        layers=48,
        heads=32,
        kv_heads=4,
        head_dim=128,
        experts=128,
        experts_used=8,
        expert_ffn=768,
        dense_ffn=6144,
        context=40960,
        rope_theta=1e6,
        rms_eps=1e-6,
    ),
}
# Qwen's special tokens at their ids in the release's vocabulary
SPECIAL_TOKENS = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}


def tensor_plan(shape: FullShape) -> list[tuple[str, tuple[int, ...], Q]]:
    """(GGUF name, numpy shape, type) of every tensor, in the order llama.cpp's converter writes them."""
    d, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    e, f = shape.experts, shape.expert_ffn
    plan = [("token_embd.weight", (shape.vocab, d), Q.Q4_0)]
    for i in range(shape.layers):
        b = f"blk.{i}."
        plan += [
            (b + "attn_norm.weight", (d,), Q.F32),
            (b + "attn_q.weight", (q, d), Q.Q4_0),
            (b + "attn_k.weight", (kv, d), Q.Q4_0),
            (b + "attn_v.weight", (kv, d), Q.Q4_0),
            (b + "attn_output.weight", (d, q), Q.Q4_0),
            (b + "attn_q_norm.weight", (shape.head_dim,), Q.F32),
            (b + "attn_k_norm.weight", (shape.head_dim,), Q.F32),
            (b + "ffn_norm.weight", (d,), Q.F32),
            (b + "ffn_gate_inp.weight", (e, d), Q.F32),
            (b + "ffn_gate_exps.weight", (e, f, d), Q.Q4_0),
            (b + "ffn_up_exps.weight", (e, f, d), Q.Q4_0),
            (b + "ffn_down_exps.weight", (e, d, f), Q.Q4_0),
        ]
    plan += [("output_norm.weight", (d,), Q.F32), ("output.weight", (shape.vocab, d), Q.Q6_K)]
    return plan


def value_std(name: str, layers: int) -> float:
    """The standard deviation of a tensor's values (see WEIGHT_STD)."""
    if name == "token_embd.weight":
        return EMBED_STD
    if name.endswith(("attn_output.weight", "ffn_down_exps.weight")):
        return WEIGHT_STD / (2 * layers) ** 0.5
    return WEIGHT_STD


def random_tensor(rng, name: str, shape: tuple[int, ...], kind: Q, layers: int) -> np.ndarray:
    """Random contents of one tensor: norms ones, float32 normal, Q4_0 / Q6_K blocks of uniform codes whose scales
    give values of about value_std's (a scale per block drawn within +-25%). Q4_0's
    codes are drawn with mean 0 (code -8 becomes 0): uniform codes -8..7 would give every row of every product the
    same offset, a direction all hidden states share."""
    if kind == Q.F32:
        if name.endswith("norm.weight"):
            return np.ones(shape, np.float32)
        return (rng.standard_normal(shape, np.float32) * WEIGHT_STD).astype(np.float32)
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    blocks = int(np.prod(shape)) // block_values
    data = np.frombuffer(rng.bytes(blocks * block_bytes), np.uint8).reshape(blocks, block_bytes).copy()
    jitter = rng.uniform(0.75, 1.25, blocks) * value_std(name, layers)
    if kind == Q.Q4_0:  # d (float16), then 16 bytes of two 4-bit codes q; value = d (q - 8), std(q - 8) ~ 4.2
        codes = data[:, 2:]
        low, high = codes & 0x0F, codes >> 4
        low[low == 0], high[high == 0] = 8, 8
        data[:, 2:] = low | (high << 4)
        data[:, :2] = (jitter / 4.2).astype(np.float16).view(np.uint8).reshape(blocks, 2)
    elif kind == Q.Q6_K:  # ql[128], qh[64], 16 int8 scales, d (float16); value = d sc (q - 32), std(q - 32) ~ 18.5
        scales = rng.integers(8, 24, (blocks, 16)).astype(np.int8)
        data[:, 192:208] = scales.view(np.uint8)
        data[:, 208:] = (jitter / (18.5 * 16)).astype(np.float16).view(np.uint8).reshape(blocks, 2)
    else:
        raise ValueError(f"{name}: no random blocks for {kind.name}")
    return data.reshape(*shape[:-1], shape[-1] // block_values * block_bytes)


def tokenizer_metadata(vocab: int) -> dict:
    """A byte-level BPE vocabulary of `vocab` tokens with Qwen's special tokens where the release has them: enough
    for llama.cpp and moe_jax to load the file (the benchmarks feed token ids, never text)."""
    tokens = ["t", *"0123456789", "t0", *(f"t{i}" for i in range(12, vocab))]  # "t" + "0" merge into "t0"
    for i, token in SPECIAL_TOKENS.items():
        if i < vocab:
            tokens[i] = token
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if i in SPECIAL_TOKENS else 1 for i in range(vocab)],
        "tokenizer.ggml.merges": ["t 0"],
        "tokenizer.ggml.eos_token_id": 151645,
        "tokenizer.ggml.padding_token_id": 151643,
        "tokenizer.ggml.add_bos_token": False,
    }


def _metadata(writer: gguf.GGUFWriter, shape: FullShape, name: str):
    writer.add_name(f"{name} (random weights)")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.dense_ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_expert_count(shape.experts)
    writer.add_expert_used_count(shape.experts_used)
    writer.add_expert_feed_forward_length(shape.expert_ffn)
    meta = tokenizer_metadata(shape.vocab)
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    writer.add_pad_token_id(meta["tokenizer.ggml.padding_token_id"])
    writer.add_add_bos_token(meta["tokenizer.ggml.add_bos_token"])


def write_random_gguf(path: Path, shape_name: str, seed: int = 0, progress: bool = True) -> Path:
    """Writes the whole random-weight model of `shape_name` (FULL_SHAPES) to `path` tensor by tensor (one tensor in
    memory at a time), under a temporary name renamed into place when complete; an existing file is kept."""
    path = Path(path)
    if path.exists():
        return path
    shape = FULL_SHAPES[shape_name]
    partial = path.with_name(path.name + ".partial")
    writer = gguf.GGUFWriter(str(partial), shape.arch)
    _metadata(writer, shape, shape_name)
    plan = tensor_plan(shape)
    for name, dims, kind in plan:
        block_values, block_bytes = gguf.GGML_QUANT_SIZES[kind]
        nbytes = int(np.prod(dims)) // block_values * block_bytes
        writer.add_tensor_info(name, dims, np.dtype(np.float32), nbytes, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    total = sum(int(np.prod(d)) // gguf.GGML_QUANT_SIZES[k][0] * gguf.GGML_QUANT_SIZES[k][1] for _, d, k in plan)
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {path.name}", disable=not progress) as bar:
        for name, dims, kind in plan:
            data = random_tensor(rng, name, dims, kind, shape.layers)
            writer.write_tensor_data(data)
            bar.update(data.nbytes)
    writer.close()
    partial.rename(path)
    return path


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=list(FULL_SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--out", type=Path, required=True, help="the .gguf file to write (kept if it exists)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_random_gguf(args.out, args.shape, args.seed))


if __name__ == "__main__":
    sys.exit(main())
