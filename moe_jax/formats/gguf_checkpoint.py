"""GGUF files (llama.cpp's format) read as a Hugging Face checkpoint: the config from the file's metadata
(gguf_config) and the tensors under their Hugging Face names and layout, dequantized to float32 as they are read
by the `gguf` package (llama.cpp's own reference code for every type).

How it works and why: docs/INTERNALS.md, moe_jax/formats/gguf_checkpoint.py.
"""

from __future__ import annotations

import math
import re
import struct
from pathlib import Path

import gguf
import numpy as np

from host_kernels import LayerExperts, QuantizedLayerExperts, pack_int4_layer, pack_mxfp4_layer
from moe_jax.errors import CheckpointError
from moe_jax.formats import gguf_delta_net, hf_names
from moe_jax.formats.gguf_config import ARCHITECTURES, hf_config
from moe_jax.formats.hf_config import read_hf_config

# names of a layer's tensors: GGUF (after "blk.N.") -> Hugging Face (after "model.layers.N."); "{moe}" and
# "{shared}" are the family's MoE and shared-expert module names
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",  # glm4moe
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "indexer.attn_q_b": "self_attn.indexer.wq_b",  # DeepSeek-V3.2's lightning indexer
    "indexer.attn_k": "self_attn.indexer.wk",
    "indexer.k_norm": "self_attn.indexer.k_norm",
    "indexer.proj": "self_attn.indexer.weights_proj",
    "ffn_gate_inp_shexp": "{moe}.shared_expert_gate",
    "ffn_gate_shexp": "{moe}.{shared}.gate_proj",
    "ffn_up_shexp": "{moe}.{shared}.up_proj",
    "ffn_down_shexp": "{moe}.{shared}.down_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": hf_names.EMBED,
    "output_norm.weight": f"{hf_names.FINAL_NORM}.weight",
    "output.weight": hf_names.LM_HEAD,
}
DELTA_NET = gguf_delta_net.ARCHITECTURES
_EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps")
_BLOCK = re.compile(r"blk\.(\d+)\.(.+?)(?:\.(weight|bias))?$")  # (DeltaNet's ssm_a has no suffix)
_PER_EXPERT = re.compile(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight")


def is_gguf_file(path) -> bool:
    return Path(path).suffix.lower() == ".gguf"


class GGUFFile:
    """One .gguf file: its metadata, its Hugging Face config and its tensors under Hugging Face names (what
    checkpoint.Checkpoint reads of a safetensors_io.TensorSource: names, shape, get)."""

    def __init__(self, path):
        self.path = self.directory = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: no such GGUF file")
        try:
            self.reader = gguf.GGUFReader(str(self.path), "r")
        except (ValueError, OSError, KeyError, IndexError, TypeError, UnicodeDecodeError, struct.error) as e:
            # what the reader raises on a damaged or hostile file
            raise CheckpointError(f"{self.path}: not a readable GGUF file ({e})") from None
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.arch = self.field("general.architecture")
        if self.arch not in ARCHITECTURES or (self.arch == "llama" and not self.arch_field("expert_count", 0)):
            kind = f"{self.arch!r} without experts" if self.arch == "llama" else repr(self.arch)
            raise CheckpointError(
                f"{self.path}: GGUF architecture {kind} is not supported; supported: "
                f"{', '.join(ARCHITECTURES)} (llama with experts: Mixtral)"
            )
        per_expert = next((n for n in self.tensors if _PER_EXPERT.fullmatch(n)), None)
        if per_expert is not None:
            raise CheckpointError(
                f"{self.path}: experts stored one tensor each ({per_expert!r}), llama.cpp's layout before April "
                "2024; convert the model again with a current llama.cpp (stacked ffn_*_exps tensors)"
            )
        try:
            self.hf_config = hf_config(self)
        except (TypeError, ValueError) as e:  # a metadata value of the wrong type (a string where a count goes)
            raise CheckpointError(f"{self.path}: unreadable GGUF metadata ({e})") from None
        self.config = read_hf_config(self.hf_config, source=f"{self.path} (its metadata)")
        self._names = self._hf_names()

    # --- metadata ---
    def field(self, key: str, default=None):
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except UnicodeDecodeError:  # a string value that is not UTF-8 (a damaged file)
            raise CheckpointError(f"{self.path}: GGUF metadata {key!r} is not UTF-8 text") from None

    def arch_field(self, key: str, default=None):
        return self.field(f"{self.arch}.{key}", default)

    def tensor_shape(self, gguf_name: str, required: bool = True, ndim: int | None = None) -> tuple[int, ...] | None:
        """A tensor's numpy shape (GGUF lists dimensions innermost first); a missing one (or one of another rank
        than `ndim`) is a CheckpointError, or None when not `required`."""
        tensor = self.tensors.get(gguf_name)
        if tensor is None:
            if required:
                raise CheckpointError(f"{self.path}: the file has no tensor {gguf_name!r}")
            return None
        shape = tuple(int(n) for n in reversed(tensor.shape))
        if ndim is not None and len(shape) != ndim:
            raise CheckpointError(f"{self.path}: tensor {gguf_name!r} has shape {shape}, expected {ndim} dimensions")
        return shape

    def layer_has(self, layer: int, name: str) -> bool:
        return f"blk.{layer}.{name}.weight" in self.tensors

    # --- tensors under Hugging Face names ---
    def _hf_names(self) -> dict[str, tuple[str, str | int]]:
        """Hugging Face name -> where it comes from: ("tensor", GGUF name), or ("gate_up" | "down" | "kv_b", layer)
        for the tensors llama.cpp stores differently."""
        layers = self.config.num_layers
        moe, shared = hf_names.moe_module(self.config), hf_names.shared_expert_module(self.config)
        names = {}
        for name in self.tensors:
            if name in _GLOBAL_NAMES:
                names[_GLOBAL_NAMES[name]] = ("tensor", name)
                continue
            m = _BLOCK.match(name)
            if m is None or int(m.group(1)) >= layers:  # rope_freqs (recomputed), MTP / nextn layers
                continue
            layer, part, kind = int(m.group(1)), m.group(2), m.group(3)
            prefix = hf_names.layer(layer)
            delta_net = gguf_delta_net.hf_name(self.arch, part, kind) if self.arch in DELTA_NET else None
            if delta_net == gguf_delta_net.FUSED_QKVZ:
                names[f"{prefix}.{delta_net}"] = ("qkvz", layer)
            elif delta_net is not None:
                names[f"{prefix}.{delta_net}"] = ("tensor", name)
            elif kind is None:
                raise CheckpointError(f"{self.path}: tensor {name!r} is not one moe_jax knows for {self.arch!r}")
            elif part in _EXPERTS and kind == "bias":  # GPT-OSS: each expert's biases, gate and up apart
                gate_up_bias, down_bias = hf_names.expert_biases(self.config, layer)
                names[down_bias if part == "ffn_down_exps" else gate_up_bias] = (
                    ("tensor", name) if part == "ffn_down_exps" else ("gate_up_bias", layer)
                )
            elif part in _EXPERTS:
                which = "down" if part == "ffn_down_exps" else "gate_up"
                names[f"{prefix}.{moe}.experts.{which}_proj"] = (which, layer)
            elif part == "ffn_gate_inp":
                names[f"{hf_names.router(self.config, layer)}.{kind}"] = ("tensor", name)
            elif part == "attn_sinks":
                names[f"{hf_names.attention(layer)}.sinks"] = ("tensor", name)
            elif part in ("attn_k_b", "attn_v_b"):
                names[f"{prefix}.self_attn.kv_b_proj.weight"] = ("kv_b", layer)
            elif part == "exp_probs_b":  # its .bias is the router's correction bias
                names[hf_names.router_bias(self.config, layer)] = ("tensor", name)
            elif part in _LAYER_NAMES:
                names[f"{prefix}.{_LAYER_NAMES[part].format(moe=moe, shared=shared)}.{kind}"] = ("tensor", name)
            else:
                raise CheckpointError(f"{self.path}: tensor {name!r} is not one moe_jax knows for {self.arch!r}")
        return names

    def names(self):
        return list(self._names)

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's Hugging Face shape, from the file's header (nothing is read or dequantized)."""
        kind, key = self._where(name)
        if kind == "tensor":
            shape = self.tensor_shape(key)
            if self.arch in DELTA_NET:
                shape = gguf_delta_net.hf_shape(name, shape)
            return (1, *shape) if name.endswith("shared_expert_gate.weight") and len(shape) == 1 else shape
        if kind == "qkvz":
            qkv, z = (self.tensor_shape(f"blk.{key}.attn_{p}.weight", ndim=2) for p in ("qkv", "gate"))
            return qkv[0] + z[0], qkv[1]
        if kind == "kv_b":
            heads, rank, nope = self.tensor_shape(f"blk.{key}.attn_k_b.weight", ndim=3)
            return heads * (nope + self.tensor_shape(f"blk.{key}.attn_v_b.weight", ndim=3)[1]), rank
        if kind == "gate_up_bias":
            experts, ffn = self.tensor_shape(f"blk.{key}.ffn_gate_exps.bias", ndim=2)
            return experts, 2 * ffn
        experts, hidden, ffn = self.tensor_shape(f"blk.{key}.ffn_down_exps.weight", ndim=3)
        return (experts, hidden, ffn) if kind == "down" else (experts, 2 * ffn, hidden)

    def dense_layout(self, names, dtype) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """{name: (shape, dtype to store it in)} of the (dense) tensors `names`: float32 where the file holds every
        part of it as F32 (norms, routers: small, and exact only so), else `dtype` (a converted model's dense
        weights in its own precision: float32 values of a quantized file's blocks would take twice bfloat16's
        bytes for nothing the bfloat16 model computes with)."""
        f32 = gguf.GGMLQuantizationType.F32
        layout = {}
        for name in names:
            parts = self._source_tensors(name)
            exact = all(self.tensors[part].tensor_type == f32 for part in parts)
            layout[name] = (self.shape(name), np.dtype(np.float32 if exact else dtype))
        return layout

    def _source_tensors(self, name: str) -> list[str]:
        """The GGUF tensors a Hugging Face tensor is made of."""
        kind, key = self._where(name)
        if kind == "tensor":
            return [key]
        parts = {"qkvz": ("attn_qkv", "attn_gate"), "kv_b": ("attn_k_b", "attn_v_b")}.get(kind)
        if parts is not None:
            return [f"blk.{key}.{p}.weight" for p in parts]
        if kind == "gate_up_bias":
            return [f"blk.{key}.ffn_{p}_exps.bias" for p in ("gate", "up")]
        gate_up, down = self._expert_tensors(key)
        return [down] if kind == "down" else gate_up

    def release_pages(self):
        pass  # the file is memory-mapped read-only; its pages are the kernel's to drop

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """A tensor by Hugging Face name and layout, dequantized to float32; checked against `shape` if given."""
        kind, key = self._where(name)
        if kind == "tensor":
            array = self._tensor(key)
            if self.arch in DELTA_NET:
                array = gguf_delta_net.hf_value(self.arch, name, array, self.config.linear_attention)
            array = array.reshape(self.shape(name))
        elif kind == "qkvz":
            qkv, z = (self._tensor(f"blk.{key}.attn_{p}.weight") for p in ("qkv", "gate"))
            array = gguf_delta_net.fused_qkvz(qkv, z, self.config.linear_attention)
        elif kind == "kv_b":
            array = self._kv_b(key)
        elif kind == "gate_up_bias":  # as GPT-OSS's safetensors hold them: gate and up interleaved
            gate, up = (self._tensor(f"blk.{key}.ffn_{p}_exps.bias") for p in ("gate", "up"))
            array = np.stack([gate, up], axis=-1).reshape(gate.shape[0], -1)
        else:  # the routed experts, in transformers 5's fused layout: gate_up [e, 2f, d], down [e, d, f]
            experts = self.layer_experts(key, np.float32)
            array = (experts.w2 if kind == "down" else experts.w13).transpose(0, 2, 1)
        if shape is not None and tuple(array.shape) != tuple(shape):
            raise CheckpointError(f"{self.path}: tensor {name!r} has shape {tuple(array.shape)}, expected {shape}")
        return array

    def _where(self, name: str) -> tuple[str, str | int]:
        if name not in self._names:
            raise CheckpointError(f"{self.path}: no tensor for {name!r}")
        return self._names[name]

    def _tensor(self, gguf_name: str) -> np.ndarray:
        shape = self.tensor_shape(gguf_name)  # first: a missing tensor refused by name
        array = self._dequantized(gguf_name, self.tensors[gguf_name].data, shape)
        if self.arch == "llama" and re.search(r"\.attn_[qk]\.weight$", gguf_name):
            heads = self.config.num_heads if ".attn_q." in gguf_name else self.config.num_kv_heads
            array = _unpermute_rotary_rows(array, heads)
        return array

    def _dequantized(self, gguf_name: str, data: np.ndarray, shape: tuple[int, ...], what: str = "") -> np.ndarray:
        """`data` (all of a tensor's blocks, or one expert's) as float32 of `shape`, refused by name when its type
        cannot be dequantized, its size does not match or a value is not finite."""
        kind = self.tensors[gguf_name].tensor_type
        where = f"{self.path}: tensor {gguf_name!r}{what}"
        try:
            array = _dequantize(data, kind)
        except NotImplementedError:
            raise CheckpointError(f"{where} is {kind.name}, which the gguf package cannot dequantize") from None
        if array.size != math.prod(shape):
            raise CheckpointError(f"{where} holds {array.size} values for shape {shape}")
        if not np.isfinite(array).all():
            raise CheckpointError(f"{where} holds NaN or infinite values")
        return array.reshape(shape)

    def layer_experts(self, layer: int, dtype) -> LayerExperts:
        """One MoE layer's experts straight into the kernel layout (w13 [e, d, 2f], w2 [e, f, d]) in `dtype`,
        dequantized expert by expert: no float32 copy of the whole layer (a real model's is gigabytes)."""
        gate_up, down = self._expert_tensors(layer)
        experts, hidden, ffn = self.tensor_shape(down, ndim=3)
        w13, w2 = np.empty((experts, hidden, 2 * ffn), dtype), np.empty((experts, ffn, hidden), dtype)
        width = 2 * ffn // len(gate_up)  # one fused tensor, or the gate's then the up's
        for e in range(experts):
            for i, name in enumerate(gate_up):
                w13[e, :, i * width : (i + 1) * width] = self._expert(name, e, (width, hidden)).T
            w2[e] = self._expert(down, e, (hidden, ffn)).T
        return LayerExperts(w13, w2)

    def _expert_tensors(self, layer: int) -> tuple[list[str], str]:
        """The GGUF names of a layer's stacked experts: ([gate_up] or [gate, up], down)."""
        fused = self.layer_has(layer, "ffn_gate_up_exps")
        gate_up = ["ffn_gate_up_exps"] if fused else ["ffn_gate_exps", "ffn_up_exps"]
        return [f"blk.{layer}.{p}.weight" for p in gate_up], f"blk.{layer}.ffn_down_exps.weight"

    def _expert(self, gguf_name: str, expert: int, shape: tuple[int, int]) -> np.ndarray:
        """Expert `expert`'s [out, in] slice of a stacked expert tensor, dequantized and checked."""
        stacked = self.tensor_shape(gguf_name, ndim=3)
        if stacked[1:] != shape:
            raise CheckpointError(f"{self.path}: tensor {gguf_name!r} has shape {stacked}, expected [e, *{shape}]")
        return self._dequantized(gguf_name, self.tensors[gguf_name].data[expert], shape, f" expert {expert}")

    def _kv_b(self, layer: int) -> np.ndarray:
        """MLA's kv_b_proj [heads * (nope + v), kv_lora_rank] from llama.cpp's k_b [heads, rank, nope] (stored
        transposed for the absorbed product) and v_b [heads, v, rank]."""
        k_b = self._tensor(f"blk.{layer}.attn_k_b.weight")
        v_b = self._tensor(f"blk.{layer}.attn_v_b.weight")
        heads, rank = k_b.shape[0], k_b.shape[1]
        kv_b = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)
        return kv_b.reshape(heads * kv_b.shape[1], rank)

    def experts_type(self) -> str:
        """The GGML type of the first MoE layer's down-projection experts ("Q4_0", "Q6_K", "F32", ...)."""
        _, down = self._expert_tensors(self.config.moe_layers[0])
        return self.tensors[down].tensor_type.name

    def closest_quant(self) -> str | None:
        """The expert format of moe_jax closest to this file's: None for float types, int4 for Q4_0 (the same
        format) and the other types of at most 5 bits a weight, mxfp4 for MXFP4 (the same), int8 for 6 and 8
        bits."""
        kind = self.experts_type()
        if kind in ("F32", "F16", "BF16"):
            return None
        if kind == "MXFP4":
            return "mxfp4"
        return "int8" if kind.startswith(("Q8", "Q6", "I8", "I16")) else "int4"

    def q4_0_layer(self, layer: int) -> QuantizedLayerExperts | None:
        """Layer `layer`'s experts repacked, value for value, as int4 experts, when all of them are stored Q4_0;
        None otherwise."""
        tensors = self._quantized_expert_tensors(layer, gguf.GGMLQuantizationType.Q4_0)
        if tensors is None:
            return None
        return pack_int4_layer(*self._stacked_codes(tensors, _q4_0_codes))

    def _quantized_expert_tensors(self, layer: int, kind) -> list | None:
        """The layer's stacked expert tensors when every one is of GGML type `kind`, else None."""
        gate_up, down = self._expert_tensors(layer)
        names = [*gate_up, down]
        for name in names:
            self.tensor_shape(name, ndim=3)  # present and stacked, or refused by name
        tensors = [self.tensors[name] for name in names]
        return None if any(t.tensor_type != kind for t in tensors) else tensors

    def mxfp4_layer(self, layer: int) -> QuantizedLayerExperts | None:
        """Layer `layer`'s experts repacked code for code as MXFP4 experts, when all of them are stored MXFP4;
        None otherwise."""
        tensors = self._quantized_expert_tensors(layer, gguf.GGMLQuantizationType.MXFP4)
        return None if tensors is None else pack_mxfp4_layer(*self._stacked_codes(tensors, _mxfp4_codes))

    def _stacked_codes(self, tensors, decode) -> tuple[np.ndarray, ...]:
        """(w13 values, w13 scales, w2 values, w2 scales) in the store's [e, k = in, n = out] from the stacked
        [e, out, in] tensors (gate, up, down or gate_up, down) `decode` reads."""
        codes = [[a.transpose(0, 2, 1) for a in decode(t.data, self.tensor_shape(t.name))] for t in tensors]
        w2_q, w2_scale = codes.pop()
        w13_q, w13_scale = (np.concatenate(parts, axis=2) for parts in zip(*codes, strict=True))
        return w13_q, w13_scale, w2_q, w2_scale


DEQUANTIZE_ROWS = 4096  # rows of a 2-d tensor dequantized at once: the package's temporaries stay small


def _dequantize(data: np.ndarray, kind) -> np.ndarray:
    """The gguf package's float32 values of `data`, DEQUANTIZE_ROWS rows at a time into one array (its
    dequantizers' temporaries for a whole 151,936-row head came to several times the head's float32 bytes)."""
    if data.ndim != 2 or data.shape[0] <= DEQUANTIZE_ROWS:
        return np.asarray(gguf.quants.dequantize(data, kind), np.float32)
    first = np.asarray(gguf.quants.dequantize(data[:DEQUANTIZE_ROWS], kind), np.float32)
    out = np.empty((data.shape[0], *first.shape[1:]), np.float32)
    out[:DEQUANTIZE_ROWS] = first
    for row in range(DEQUANTIZE_ROWS, data.shape[0], DEQUANTIZE_ROWS):
        out[row : row + DEQUANTIZE_ROWS] = gguf.quants.dequantize(data[row : row + DEQUANTIZE_ROWS], kind)
    return out


def _mxfp4_codes(data: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """ggml's MXFP4 blocks (per 32 values: an e8m0 exponent byte, then 16 bytes whose low nibbles are codes 0..15
    and high nibbles codes 16..31) as e2m1 codes uint8 [..., n] and exponents [..., n / 32]."""
    blocks = np.asarray(data).reshape(-1, 17)
    exponents = blocks[:, 0].reshape(*shape[:-1], shape[-1] // 32)
    nibbles = blocks[:, 1:]
    return np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1).reshape(shape), exponents


def _q4_0_codes(data: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Q4_0 blocks (per 32 values: a float16 scale d, then 16 bytes whose low nibbles are values 0..15 and high
    nibbles values 16..31, each stored + 8) as int8 codes [..., n] and float16 scales [..., n / 32]."""
    blocks = np.asarray(data).reshape(-1, 18)
    scale = blocks[:, :2].copy().view(np.float16).reshape(*shape[:-1], shape[-1] // 32)
    nibbles = blocks[:, 2:]
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1).astype(np.int8) - 8
    return codes.reshape(shape), scale


def _unpermute_rotary_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's converter for llama-architecture q/k weights, which reorders each head's rows from
    Hugging Face's rotate-half layout to ggml's interleaved pairs."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
