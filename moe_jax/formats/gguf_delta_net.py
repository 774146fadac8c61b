"""llama.cpp's layout of the Gated DeltaNet families (`qwen3next`: Qwen3-Next; `qwen35moe`: Qwen3.5-MoE), undone.

How it works and why: docs/INTERNALS.md, moe_jax/formats/gguf_delta_net.py.
"""

from __future__ import annotations

import numpy as np

ARCHITECTURES = ("qwen3next", "qwen35moe")

# (GGUF part after "blk.N.", its suffix) -> the Hugging Face name after "model.layers.N."
_NAMES = {
    ("ssm_conv1d", "weight"): "linear_attn.conv1d.weight",
    ("ssm_dt", "bias"): "linear_attn.dt_bias",
    ("ssm_a", None): "linear_attn.A_log",
    ("ssm_norm", "weight"): "linear_attn.norm.weight",
    ("ssm_out", "weight"): "linear_attn.out_proj.weight",
    ("ssm_ba", "weight"): "linear_attn.in_proj_ba.weight",
    ("ssm_beta", "weight"): "linear_attn.in_proj_b.weight",
    ("ssm_alpha", "weight"): "linear_attn.in_proj_a.weight",
    ("attn_qkv", "weight"): "linear_attn.in_proj_qkv.weight",
    ("attn_gate", "weight"): "linear_attn.in_proj_z.weight",
}
FUSED_QKVZ = "linear_attn.in_proj_qkvz.weight"  # Qwen3-Next's, from attn_qkv and attn_gate
_VALUE_ROWS = ("in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")


def hf_name(arch: str, part: str, suffix: str | None) -> str | None:
    """The Hugging Face name (after the layer prefix) of a DeltaNet tensor, or None for any other."""
    name = _NAMES.get((part, suffix))
    if arch == "qwen3next" and part in ("attn_qkv", "attn_gate"):
        return FUSED_QKVZ
    return name


def hf_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A tensor's Hugging Face shape from its GGUF one (the convolution's middle axis back)."""
    return (shape[0], 1, shape[1]) if name.endswith("conv1d.weight") else shape


def hf_value(arch: str, name: str, array: np.ndarray, spec) -> np.ndarray:
    """A tensor read from the file with the values the Hugging Face checkpoint holds (`spec`: the LinearAttention;
    its shape is `hf_shape`'s, which the caller gives it)."""
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        array = array - 1.0  # stored 1 + w
    elif name.endswith("A_log"):
        array = np.log(-array)  # stored A = -exp(A_log)
    if arch == "qwen35moe" and ".linear_attn." in name and spec.num_v_heads != spec.num_k_heads:
        array = _grouped_value_heads(name, array, spec)
    return array


def fused_qkvz(qkv: np.ndarray, z: np.ndarray, spec) -> np.ndarray:
    """Qwen3-Next's in_proj_qkvz [k heads x (q, k, values, z), d] from attn_qkv [q all, k all, v all] and z."""
    hk, d = spec.num_k_heads, qkv.shape[-1]
    q, k, v = np.split(qkv, [spec.key_dim, 2 * spec.key_dim])
    per_head = [part.reshape(hk, -1, d) for part in (q, k, v, z)]
    return np.concatenate(per_head, axis=1).reshape(-1, d)


def _grouped_value_heads(name: str, array: np.ndarray, spec) -> np.ndarray:
    """Qwen3.5's value heads from ggml's tiled order back to grouped by key head, along the axis that has them."""
    per_key = spec.num_v_heads // spec.num_k_heads
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):  # queries and keys, then the values
        qk, v = np.split(array, [2 * spec.key_dim])
        return np.concatenate([qk, _untile(v, 0, spec.num_k_heads, per_key)])
    if name.endswith("out_proj.weight"):  # its inputs are the value heads
        return _untile(array, 1, spec.num_k_heads, per_key)
    if name.endswith(_VALUE_ROWS):
        return _untile(array, 0, spec.num_k_heads, per_key)
    return array  # the gated norm's weight is one per value dimension, shared by the heads


def _untile(array: np.ndarray, axis: int, key_heads: int, per_key: int) -> np.ndarray:
    """Rows (or columns) in tiled order [per_key, key_heads, ...] back to grouped [key_heads, per_key, ...]."""
    moved = np.moveaxis(array, axis, 0)
    tiled = moved.reshape(per_key, key_heads, -1, *moved.shape[1:])
    grouped = tiled.swapaxes(0, 1).reshape(moved.shape)
    return np.moveaxis(grouped, 0, axis)
