"""Reading a checkpoint directory: a Hugging Face one, or one written by `python -m moe_jax.convert`.

Both kinds hold `config.json`, the non-expert tensors under their Hugging Face names in `*.safetensors`, and
optionally `tokenizer.json`. A converted directory keeps the experts in an `experts/` store (host kernel layout,
memory-mapped); a Hugging Face directory keeps them per expert (or fused, as transformers 5 can write), and they are
stacked into the kernel layout one layer at a time.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from host_kernels import (
    ExpertStore,
    LayerExperts,
    QuantizedLayerExperts,
    StoreError,
    pack_mxfp4_layer,
    quantize_layer,
)
from moe_jax.distributed import ExpertShard
from moe_jax.errors import CheckpointError, is_int, read_json_file
from moe_jax.formats import fp8, hf_names, mxfp4
from moe_jax.formats.gguf_checkpoint import GGUFFile, is_gguf_file
from moe_jax.formats.hf_config import language_model_config, read_hf_config
from moe_jax.formats.safetensors_io import TensorSource
from moe_jax.model.config import ModelConfig

EXPERT_STORE_DIR = "experts"
_SHARD_STORE = re.compile(rf"{EXPERT_STORE_DIR}\.shard-(\d+)-of-(\d+)")  # convert --expert-shards N's stores

# what a checkpoint directory holds beside its weights that moe_jax reads (or a converted directory copies)
SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def shard_store_name(shard: ExpertShard) -> str:
    """The directory of one shard's store in a checkpoint converted with --expert-shards."""
    return f"{EXPERT_STORE_DIR}.shard-{shard.index}-of-{shard.count}"


@dataclass
class Checkpoint:
    path: Path
    config: ModelConfig
    tensors: TensorSource | fp8.BlockScaledTensors | mxfp4.MXFP4Tensors | GGUFFile
    expert_store: ExpertStore | None  # set for converted directories
    store_experts: range | None = None  # the experts the store holds when it is one shard's (else all of them)

    @property
    def is_converted(self) -> bool:
        return self.expert_store is not None

    def has(self, name: str) -> bool:
        return name in self.tensors

    def own_dtype(self) -> str:
        """The model dtype that keeps this checkpoint's precision in the least memory (what dtype="auto" loads):
        bfloat16 where its weights are bfloat16 or narrower (fp8, a quantized GGUF's blocks), float32 where they
        are float32 or float16 (exact in float32, rounded in bfloat16). A GGUF file is judged by its experts, a
        converted directory by its expert store (the dtype convert chose from its source), a safetensors
        checkpoint by its embedding table (an fp8 checkpoint's dense weights are bfloat16)."""
        if self.expert_store is not None:
            return "bfloat16" if self.expert_store.dtype == np.dtype(ml_dtypes.bfloat16) else "float32"
        if isinstance(self.tensors, GGUFFile):
            return "float32" if self.tensors.experts_type() in ("F32", "F16") else "bfloat16"
        quantized = isinstance(self.tensors, (fp8.BlockScaledTensors, mxfp4.MXFP4Tensors))
        source = self.tensors.source if quantized else self.tensors
        if hf_names.EMBED not in source:
            raise CheckpointError(f"{self.path}: tensor {hf_names.EMBED!r} is missing from the checkpoint")
        return "bfloat16" if source.dtype_code(hf_names.EMBED) in ("BF16", "F8_E4M3") else "float32"

    def dense(self, name: str) -> np.ndarray:
        """A non-expert tensor by Hugging Face name, shape-checked, in `x @ W` layout (Linear weights transposed)."""
        array = self.tensors.get(name, expected_dense_shape(self.config, name))
        if array.ndim == 2 and name.endswith(".weight") and "embed_tokens" not in name:
            array = array.T
        return array

    def expert_gate_up_bias(self, layer: int, experts: range | None = None) -> np.ndarray | None:
        """A layer's experts' gate/up biases [e, 2f] (all, or only `experts`) in kernel order, gate columns then up
        (the layout of `LayerExperts.w13`), float32; None for a family without them."""
        if not self.config.expert_bias:
            return None
        b = np.asarray(self.tensors.get(hf_names.expert_biases(self.config, layer)[0]), np.float32)
        return gate_then_up(b if experts is None else b[experts.start : experts.stop])

    def layer_experts(self, layer: int, dtype: np.dtype, experts: range | None = None) -> LayerExperts:
        """One MoE layer's experts (all, or only `experts`) in kernel layout and `dtype` (a view when converted
        and of that dtype)."""
        if self.expert_store is not None:
            stored = self.expert_store[layer]
            if stored.quant is not None:
                raise CheckpointError(
                    f"{self.path}: its experts are stored {stored.quant}-quantized: they run on the host backend only"
                )
            if self.store_experts is not None and experts != self.store_experts:
                raise CheckpointError(f"{self.path}: its store holds experts {self.store_experts}, not {experts}")
            stored = stored if experts is None or self.store_experts is not None else stored.select(experts)
            if stored.w13.dtype == dtype:
                return stored
            return LayerExperts(stored.w13.astype(dtype), stored.w2.astype(dtype))
        if isinstance(self.tensors, GGUFFile):
            return _only(self.tensors.layer_experts(layer, dtype), experts)
        return stack_hf_experts(self.tensors, self.config, layer, dtype, experts)

    def shipped_quant(self) -> str | None:
        """The quantized expert format the checkpoint's experts load as by default: "mxfp4" for a GPT-OSS release;
        for a GGUF file with quantized experts the closest moe_jax has (Q4_0 -> int4 and MXFP4 -> mxfp4 value for
        value, other types requantized: GGUFFile.closest_quant), so a quantized file takes about its own size in
        RAM, as in llama.cpp; None otherwise (float experts)."""
        if isinstance(self.tensors, GGUFFile):
            return self.tensors.closest_quant()
        if isinstance(self.tensors, mxfp4.MXFP4Tensors) and self.config.moe_layers:
            gate_up, _ = hf_names.fused_expert_names(self.config, self.config.moe_layers[0])
            return "mxfp4" if self.tensors.is_quantized(gate_up) else None
        return None

    def quantized_layer(
        self, layer: int, quant: str, dtype: np.dtype, experts: range | None = None
    ) -> tuple[QuantizedLayerExperts, bool]:
        """One MoE layer's experts (all, or only `experts`) in `quant`'s format, and whether they arrived as they
        were stored: a GGUF file's Q4_0 experts are int4 already (repacked value for value); others are read as
        float in `dtype` and quantized (so are MXFP4 experts, GPT-OSS's or a GGUF file's, for `quant` "mxfp4"). A
        weight that cannot be quantized is a CheckpointError naming layer, expert and position."""
        if isinstance(self.tensors, GGUFFile) and quant in ("int4", "mxfp4"):
            repacked = self.tensors.q4_0_layer(layer) if quant == "int4" else self.tensors.mxfp4_layer(layer)
            if repacked is not None:
                return _only(repacked, experts), True
        if quant == "mxfp4" and self.shipped_quant() == "mxfp4" and not isinstance(self.tensors, GGUFFile):
            return stack_mxfp4_experts(self.tensors, self.config, layer, experts), True
        try:
            float_layer = self.layer_experts(layer, dtype, experts)
            return quantize_layer(float_layer, quant, f"{self.path}: layer {layer}"), False
        except StoreError as e:
            raise CheckpointError(str(e)) from None


def open_checkpoint(path, verify: bool = False, expert_shard: ExpertShard | None = None) -> Checkpoint:
    """Opens a checkpoint directory, checking its config, every weight file's header and its layer count;
    `verify=True` also checks a converted store's SHA-256 checksums (minutes for a large model). A directory
    converted with --expert-shards opens with `expert_shard`, and then only that shard's store."""
    path = Path(path)
    if is_gguf_file(path):
        gguf_file = GGUFFile(path)
        return Checkpoint(path, gguf_file.config, gguf_file, None)
    if not path.exists():
        raise CheckpointError(f"{path}: no such directory")
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory (expected a checkpoint directory or a .gguf file)")
    config_file = path / "config.json"
    hf_config = read_json_file(config_file, "a model directory")
    tensors = TensorSource.open(path)
    model_type = language_model_config(hf_config).get("model_type") if isinstance(hf_config, dict) else None
    if isinstance(model_type, str) and (prefix := hf_names.LANGUAGE_MODEL.get(model_type)) is not None:
        tensors.rename_prefix(prefix, "model.")  # the language model's weights; the others are never read
    if mxfp4.is_mxfp4(hf_config):
        tensors = mxfp4.MXFP4Tensors(tensors)
    elif (block := fp8.block_size(hf_config, config_file)) is not None:
        tensors = fp8.BlockScaledTensors(tensors, block)
    else:  # raw fp8 values without their scales would be a silently wrong model
        unscaled = next((n for n in tensors.names() if tensors.dtype_code(n) == "F8_E4M3"), None)
        if unscaled is not None:
            raise CheckpointError(
                f"{config_file}: the weights hold fp8 tensors ({unscaled!r}) but there is no quantization_config "
                "saying how they are scaled"
            )
    _check_layer_count(language_model_config(hf_config), tensors, config_file)  # first: an absurd count sizes nothing
    config = read_hf_config(hf_config, source=str(config_file))
    store, held, store_dir = None, None, path / EXPERT_STORE_DIR
    shards = {int(m.group(2)) for d in path.iterdir() if (m := _SHARD_STORE.fullmatch(d.name)) and d.is_dir()}
    if not store_dir.exists() and shards:
        held, store_dir = _shard_of(path, shards, expert_shard, config)
    if store_dir.exists():
        try:
            store = ExpertStore.open(store_dir, verify=verify)
        except StoreError as e:
            raise CheckpointError(str(e)) from e
        _check_store_fits(store, config, store_dir, len(held) if held else config.num_experts)
    return Checkpoint(path, config, tensors, store, held)


def _shard_of(path: Path, shards: set[int], shard: ExpertShard | None, config: ModelConfig) -> tuple[range, Path]:
    """(the experts, the store directory) of `shard` in a directory converted with --expert-shards."""
    counts = ", ".join(map(str, sorted(shards)))
    if shard is None:
        raise CheckpointError(
            f"{path}: its experts are stored in shards of {counts} (convert --expert-shards): each process of an "
            "expert-parallel run opens its own (train.py --expert-shards, one process per shard)"
        )
    if shard.count not in shards:
        raise CheckpointError(f"{path}: its experts are stored in shards of {counts}, not {shard.count}")
    store_dir = path / shard_store_name(shard)
    if not store_dir.is_dir():
        raise CheckpointError(f"{store_dir}: missing ({shard.describe()}); copy it from where the model was converted")
    return shard.experts(config.num_experts), store_dir


def read_config(path) -> ModelConfig:
    """The model config of a checkpoint directory (its config.json) or a .gguf file (its metadata), alone."""
    if is_gguf_file(path):
        return GGUFFile(path).config
    config_file = Path(path) / "config.json"
    return read_hf_config(read_json_file(config_file, "a model directory"), source=str(config_file))


_LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.")


def _check_layer_count(hf_config, tensors: TensorSource, config_file: Path):
    """The config's layer count must be the checkpoint's: extra layers would be silently ignored, missing ones
    found only after everything before them was loaded. DeepSeek-style multi-token-prediction layers, stored
    after the last decoder layer, are allowed. (A count that is not an integer is left to ModelConfig.from_hf.)"""
    layers = hf_config.get("num_hidden_layers") if isinstance(hf_config, dict) else None
    if not is_int(layers):
        return
    extra = hf_config.get("num_nextn_predict_layers")
    allowed_extra = range(layers, layers + extra) if isinstance(extra, int) else range(0)
    present = {int(m.group(1)) for name in tensors.names() if (m := _LAYER_TENSOR.match(name))}
    missing = sum(i < layers for i in present) < layers  # counted, not as a set: `layers` may be absurd
    if missing or any(i >= layers and i not in allowed_extra for i in present):
        found = f"layers 0..{max(present)}" if present and present == set(range(len(present))) else None
        found = found or (f"{len(present)} layer indices" if present else "no layers")
        raise CheckpointError(f"{config_file}: num_hidden_layers is {layers}, but the weights hold {found}")


def _check_store_fits(store: ExpertStore, config: ModelConfig, store_dir: Path, experts: int):
    want = (experts, config.hidden_size, config.expert_intermediate_size)
    for layer in config.moe_layers:
        w = store[layer]
        got = (w.num_experts, w.hidden, w.ffn)
        if got != want:
            raise CheckpointError(
                f"{store_dir}: layer {layer} holds {got[0]} experts of hidden {got[1]}, ffn {got[2]}; "
                f"the config says {want[0]} of {want[1]}, {want[2]}"
            )


def stack_hf_experts(
    tensors: TensorSource, config: ModelConfig, layer: int, dtype, experts: range | None = None
) -> LayerExperts:
    """A layer's experts (all, or only `experts`: only theirs are read where each expert is a tensor of its own)
    from a Hugging Face checkpoint, in kernel layout."""
    e, d, f = config.num_experts, config.hidden_size, config.expert_intermediate_size
    experts = experts if experts is not None else range(e)
    fused, fused_down = hf_names.fused_expert_names(config, layer)
    ends = slice(experts.start, experts.stop)
    if fused in tensors and config.model_type == "gpt_oss":  # x @ W layout: [e, d, 2f] gate/up interleaved, [e, f, d]
        w13 = gate_then_up(tensors.get(fused, (e, d, 2 * f))[ends])
        return LayerExperts(w13.astype(dtype), np.ascontiguousarray(tensors.get(fused_down, (e, f, d))[ends], dtype))
    if fused in tensors:  # transformers 5 fused layout: gate_up [e, 2f, d], down [e, d, f]
        gate_up = tensors.get(fused, (e, 2 * f, d))[ends]
        down = tensors.get(fused_down, (e, d, f))[ends]
        return LayerExperts(
            np.ascontiguousarray(gate_up.transpose(0, 2, 1), dtype=dtype),
            np.ascontiguousarray(down.transpose(0, 2, 1), dtype=dtype),
        )
    w13 = np.empty((len(experts), d, 2 * f), dtype=dtype)
    w2 = np.empty((len(experts), f, d), dtype=dtype)
    for row, expert in enumerate(experts):
        gate, up, down = hf_names.expert_names(config, layer, expert)
        w13[row, :, :f] = tensors.get(gate, (f, d)).T
        w13[row, :, f:] = tensors.get(up, (f, d)).T
        w2[row] = tensors.get(down, (d, f)).T
    return LayerExperts(w13, w2)


def stack_mxfp4_experts(
    tensors: mxfp4.MXFP4Tensors, config: ModelConfig, layer: int, experts: range | None = None
) -> QuantizedLayerExperts:
    """A GPT-OSS layer's MXFP4 experts (all, or only `experts`) in the kernels' layout, code for code: gate_up
    [e, 2f, d] (gate and up rows interleaved) and down [e, d, f], [out, in] as stored."""
    e, d, f = config.num_experts, config.hidden_size, config.expert_intermediate_size
    ends = slice(0, e) if experts is None else slice(experts.start, experts.stop)
    fused, fused_down = hf_names.fused_expert_names(config, layer)
    parts = []
    for name, shape in ((fused, (e, 2 * f, d)), (fused_down, (e, d, f))):
        values, exponents = tensors.codes(name)
        if values.shape != shape:
            raise CheckpointError(f"{tensors.directory}: MXFP4 tensor {name!r} holds {values.shape}, expected {shape}")
        parts.append([np.ascontiguousarray(a[ends].transpose(0, 2, 1)) for a in (values, exponents)])  # [e, in, out]
    (w13, w13_exp), (w2, w2_exp) = parts
    return pack_mxfp4_layer(gate_then_up(w13), gate_then_up(w13_exp), w2, w2_exp)


def gate_then_up(interleaved: np.ndarray) -> np.ndarray:
    """GPT-OSS's gate/up columns (last axis: gate, up, gate, up, ...) as the kernels' layout holds them: the
    gate's, then the up's."""
    return np.concatenate([interleaved[..., 0::2], interleaved[..., 1::2]], axis=-1)


def _only(layer, experts: range | None):
    """`layer` with only `experts`, copied (the whole layer it came from is freed)."""
    if experts is None:
        return layer
    return copy.deepcopy(layer.select(experts))


def expected_dense_shape(config: ModelConfig, name: str) -> tuple[int, ...] | None:
    """The Hugging Face shape of a non-expert tensor, for shape checks with a clear message."""
    d, hd = config.hidden_size, config.head_dim
    q, kv = config.num_heads * hd, config.num_kv_heads * hd
    table = {
        "embed_tokens.weight": (config.vocab_size, d),
        "lm_head.weight": (config.vocab_size, d),
        "norm.weight": (d,),
        "layernorm.weight": (d,),
        "q_proj.weight": (q, d),
        "k_proj.weight": (kv, d),
        "v_proj.weight": (kv, d),
        "o_proj.weight": (d, q),
        "q_proj.bias": (q,),
        "k_proj.bias": (kv,),
        "v_proj.bias": (kv,),
        "o_proj.bias": (d,),
        "q_norm.weight": (q,) if config.qk_norm == "full" else (hd,),
        "k_norm.weight": (kv,) if config.qk_norm == "full" else (hd,),
        "gate.weight": (config.num_experts, d),
        "router.weight": (config.num_experts, d),
        "router.bias": (config.num_experts,),
        "self_attn.sinks": (config.num_heads,),
        "experts.gate_up_proj_bias": (config.num_experts, 2 * config.expert_intermediate_size),
        "experts.down_proj_bias": (config.num_experts, d),
        "e_score_correction_bias": (config.num_experts,),
        "shared_expert_gate.weight": (1, d),
    }
    if config.mla is not None:
        table.update(_mla_shapes(config))
    if config.attention_output_gate:  # each head's query and its gate
        table.update({"q_proj.weight": (2 * q, d), "q_proj.bias": (2 * q,)})
    if config.linear_attention is not None:
        table.update(_linear_attention_shapes(config))
    if f".{hf_names.shared_expert_module(config)}." in name:
        width = config.shared_expert_intermediate_size
    else:
        width = config.dense_intermediate_size
    table.update({"gate_proj.weight": (width, d), "up_proj.weight": (width, d), "down_proj.weight": (d, width)})
    for suffix, shape in sorted(table.items(), key=lambda item: -len(item[0])):  # most specific suffix first
        if name.endswith(suffix):
            return shape
    return None


def _linear_attention_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    s, d = config.linear_attention, config.hidden_size
    return {
        "linear_attn.in_proj_qkvz.weight": (2 * s.key_dim + 2 * s.value_dim, d),
        "linear_attn.in_proj_ba.weight": (2 * s.num_v_heads, d),
        "linear_attn.in_proj_qkv.weight": (s.conv_dim, d),
        "linear_attn.in_proj_z.weight": (s.value_dim, d),
        "linear_attn.in_proj_b.weight": (s.num_v_heads, d),
        "linear_attn.in_proj_a.weight": (s.num_v_heads, d),
        "linear_attn.conv1d.weight": (s.conv_dim, 1, s.conv_kernel),
        "linear_attn.dt_bias": (s.num_v_heads,),
        "linear_attn.A_log": (s.num_v_heads,),
        "linear_attn.norm.weight": (s.v_head_dim,),
        "linear_attn.out_proj.weight": (d, s.value_dim),
    }


def _mla_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    mla, d, h = config.mla, config.hidden_size, config.num_heads
    latent = mla.kv_lora_rank + mla.rope_dim
    return {
        "q_proj.weight": (h * mla.qk_dim, d),
        "q_a_proj.weight": (mla.q_lora_rank, d),
        "q_a_proj.bias": (mla.q_lora_rank,),
        "q_a_layernorm.weight": (mla.q_lora_rank,),
        "q_b_proj.weight": (h * mla.qk_dim, mla.q_lora_rank),
        "kv_a_proj_with_mqa.weight": (latent, d),
        "kv_a_proj_with_mqa.bias": (latent,),
        "kv_a_layernorm.weight": (mla.kv_lora_rank,),
        "kv_b_proj.weight": (h * (mla.nope_dim + mla.v_dim), mla.kv_lora_rank),
        "o_proj.weight": (d, h * mla.v_dim),
        **(_indexer_shapes(config) if mla.indexer is not None else {}),
    }


def _indexer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    s, d = config.mla.indexer, config.hidden_size
    return {
        "indexer.wq_b.weight": (s.num_heads * s.head_dim, config.mla.q_lora_rank),
        "indexer.wk.weight": (s.head_dim, d),
        "indexer.k_norm.weight": (s.head_dim,),
        "indexer.k_norm.bias": (s.head_dim,),
        "indexer.weights_proj.weight": (s.num_heads, d),
    }
