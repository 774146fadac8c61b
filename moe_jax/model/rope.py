"""Rotary position embeddings: the frequencies of every scaling type a supported config uses, and their rotation.

The frequencies follow transformers' `modeling_rope_utils` (default, linear, dynamic NTK, YaRN, Llama 3), so
logits match its models. Static kinds are computed once here; dynamic NTK depends on the sequence length and is
computed in the traced step, per row (transformers takes the batch's longest row: the same for one sequence, and a
row's result here does not depend on what else shares its batch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

KINDS = ("default", "linear", "dynamic", "yarn", "llama3")


@dataclass(frozen=True)
class Rope:
    dim: int  # rotated dimensions of a head (the first `dim`; the rest pass through)
    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    # cos and sin are multiplied by it (YaRN's attention scaling; 1 elsewhere)
    attention_factor: float = 1.0
    max_positions: int = 4096  # the config's max_position_embeddings (dynamic NTK's threshold)
    original_max_positions: int = 4096  # the pretraining length (YaRN, Llama 3)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # DeepSeek lays the rotated dimensions out as pairs (x0, x1), (x2, x3), ...; everyone else as two halves
    interleave: bool = False

    def inv_freq(self) -> np.ndarray:
        """float32 inverse frequencies [dim / 2] of the static kinds (and dynamic NTK's below its threshold)."""
        base = np.float32(self.theta) ** (np.arange(0, self.dim, 2, dtype=np.float32) / np.float32(self.dim))
        inv = (1.0 / base).astype(np.float32)
        if self.kind == "linear":
            return (inv / np.float32(self.factor)).astype(np.float32)
        if self.kind == "yarn":
            return _yarn(self, base)
        if self.kind == "llama3":
            return _llama3(self, inv)
        return inv

    def cos_sin(self, positions_bt):
        """cos/sin tables [b, t, dim] (each frequency twice: [f, f]), scaled by the attention factor."""
        positions = positions_bt.astype(jnp.float32)
        if self.kind == "dynamic":
            inv_freq = self._dynamic_inv_freq(positions_bt)[:, None, :]
        else:
            inv_freq = jnp.asarray(self.inv_freq())
        freqs = positions[..., None] * inv_freq
        emb = jnp.concatenate([freqs, freqs], axis=-1)
        cos, sin = jnp.cos(emb), jnp.sin(emb)
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos, sin

    def _dynamic_inv_freq(self, positions_bt):
        """Dynamic NTK: the base grows with the sequence length past max_positions ([b, dim / 2])."""
        seq_len = jnp.maximum(jnp.max(positions_bt, axis=1) + 1, self.max_positions).astype(jnp.float32)
        ratio = self.factor * seq_len / self.max_positions - (self.factor - 1)
        base = self.theta * ratio ** (self.dim / (self.dim - 2))
        exponents = jnp.arange(0, self.dim, 2, dtype=jnp.float32) / self.dim
        return 1.0 / (base[:, None] ** exponents[None, :])

    def apply(self, x, cos, sin):
        """x rotated on its first `dim` last-axis entries; cos/sin (from `cos_sin`) reshaped to broadcast."""
        rot, rest = x[..., : self.dim], x[..., self.dim :]
        half = self.dim // 2
        if self.interleave:  # pair i is (x[2i], x[2i+1]); the output holds the pairs' firsts, then their seconds
            even, odd = rot[..., 0::2], rot[..., 1::2]
            c, s = cos[..., :half].astype(x.dtype), sin[..., :half].astype(x.dtype)
            rotated = jnp.concatenate([even * c - odd * s, odd * c + even * s], axis=-1)
        else:
            turned = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
            rotated = rot * cos.astype(x.dtype) + turned * sin.astype(x.dtype)
        return rotated if rest.shape[-1] == 0 else jnp.concatenate([rotated, rest], axis=-1)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: Rope, pos_freqs: np.ndarray) -> np.ndarray:
    def correction_dim(rotations):
        return (rope.dim * math.log(rope.original_max_positions / (rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta)
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope.dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = np.clip((np.arange(rope.dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolation = 1 - ramp
    inv_extrapolated = (1.0 / pos_freqs).astype(np.float32)
    inv_interpolated = (1.0 / (np.float32(rope.factor) * pos_freqs)).astype(np.float32)
    return (inv_interpolated * (1 - extrapolation) + inv_extrapolated * extrapolation).astype(np.float32)


def _llama3(rope: Rope, inv: np.ndarray) -> np.ndarray:
    old = rope.original_max_positions
    low_wavelen, high_wavelen = old / rope.low_freq_factor, old / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)
