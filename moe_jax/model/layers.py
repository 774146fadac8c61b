"""Dense building blocks: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP.

Parameters are stored in `x @ W` layout ([in, out]); the checkpoint importer transposes Hugging Face's [out, in].
Base weights are `Frozen` variables and LoRA weights `LoRAParam`, so `nnx.split(model, LoRAParam, ...)` separates
what trains from what never changes.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from moe_jax.model.rope import Rope
from moe_jax.native.cache_attention import cache_attention_call
from moe_jax.native.dense import dense_call, dense_rows_call, pack_dense, row_dtype, takes


class Frozen(nnx.Variable):
    """A base-model weight: read by the forward pass, never trained."""


class LoRAParam(nnx.Param):
    """A trainable low-rank adapter weight."""


def lora_arrays(lora) -> dict:
    """An expert module's LoRA parameters (an nnx.Dict, or None when none is attached) as the arrays an expert
    function takes ({} for none)."""
    return {name: p[...] for name, p in lora.items()} if lora is not None else {}


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x, weight, eps):
    return weight * _normalized(x, eps).astype(x.dtype)


def _inverse_rms(x32, eps):
    return jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def _normalized(x, eps):
    x32 = x.astype(jnp.float32)
    return x32 * _inverse_rms(x32, eps)


def _rms_norm_fwd(x, weight, eps):
    return rms_norm(x, weight, eps), (x, weight)


def _rms_norm_bwd(eps, residuals, g):
    """The gradient written out, each row's reduction once: differentiated automatically, XLA:CPU fused the
    reduction into the elementwise pass after it and recomputed it for every element (the q/k norms are per head
    of 128)."""
    x, weight = residuals
    x32 = x.astype(jnp.float32)
    r = _inverse_rms(x32, eps)
    u = (g * weight).astype(jnp.float32)
    dx = r * u - x32 * (r * r * r) * jnp.mean(u * x32, axis=-1, keepdims=True)
    dweight = jnp.sum(g * (x32 * r).astype(x.dtype), axis=tuple(range(x.ndim - weight.ndim)))
    return dx.astype(x.dtype), dweight.astype(weight.dtype)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


class RMSNorm(nnx.Module):
    """`unit_offset` (Qwen3-Next): the weight is stored as w - 1, and the norm scales by 1 + w in float32 before
    rounding to x's dtype (its order; the others round first, then scale)."""

    def __init__(self, weight, eps: float, unit_offset: bool = False):
        self.weight = Frozen(weight)
        self.eps = eps
        self.unit_offset = unit_offset

    def __call__(self, x):
        if self.unit_offset:
            return (_normalized(x, self.eps) * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        return rms_norm(x, self.weight[...], self.eps)


# The random key for LoRA dropout while a training step is traced (None: no dropout, as at evaluation).
# A context variable rather than an argument threaded through every module: only adapters read it.
_DROPOUT_KEY: contextvars.ContextVar = contextvars.ContextVar("lora_dropout_key", default=None)


# While a micro-batch of rows [start, stop) of `total` is traced (Transformer.pipelined): adapters draw the whole
# batch's dropout mask and take those rows, so a pipelined step drops exactly what the plain one does.
_DROPOUT_ROWS: contextvars.ContextVar = contextvars.ContextVar("lora_dropout_rows", default=None)


# While generation's prefill step is traced (generation/engine.py): dense products of packed weights run natively
# at any number of positions (base_matmul), as a decode step's do. Model.logits and training stay in XLA.
_NATIVE_PREFILL: contextvars.ContextVar = contextvars.ContextVar("native_prefill", default=False)


@contextlib.contextmanager
def _set_while(variable: contextvars.ContextVar, value):
    token = variable.set(value)
    try:
        yield
    finally:
        variable.reset(token)


def lora_dropout_key(key):
    return _set_while(_DROPOUT_KEY, key)


def micro_batch_rows(start: int, stop: int, total: int):
    return _set_while(_DROPOUT_ROWS, (start, stop, total))


def native_prefill():
    return _set_while(_NATIVE_PREFILL, True)


def micro_batch_slice(whole):
    """The rows of a whole batch's per-row array (first axis) that the micro-batch being traced holds (all of
    them outside a micro-batch)."""
    rows = _DROPOUT_ROWS.get()
    return whole if rows is None else whole[rows[0] : rows[1]]


def _dropout_mask(key, keep: float, shape):
    """The keep mask for an input of `shape`: of the whole batch's rows when inside a micro-batch (its first
    axis is then this micro-batch's rows, or its rows x tokens once flattened)."""
    rows = _DROPOUT_ROWS.get()
    if rows is None:
        return jax.random.bernoulli(key, keep, shape)
    start, stop, total = rows
    per_row = shape[0] // (stop - start)
    whole = jax.random.bernoulli(key, keep, (total * per_row, *shape[1:]))
    return whole[start * per_row : stop * per_row]


def frozen_matmul(x, w, w_t=None, out_dtype=None, pad_one_row: bool = False):
    """x @ w for a base weight, in `out_dtype` (default x's).

    In bfloat16 the product accumulates in float32, the form XLA:CPU hands to its fast bfloat16 GEMM (bf16 x
    bf16 -> bf16, and a transposed right operand, which it widens to float32 first, take its slow paths). The
    backward's input gradient g @ w.T has that transposed operand: given `w_t` (w transposed, as its own array)
    it runs as g @ w_t instead. float32 products are the plain x @ w.
    `pad_one_row` (the plan's, on XLA:CPU): a single row gets a second, zero one.
    """
    out_dtype = out_dtype or x.dtype
    if x.dtype != jnp.bfloat16:
        return (x @ w).astype(out_dtype)
    if w_t is None:
        if math.prod(x.shape[:-1]) == 1 and pad_one_row:
            # one row (batch-1 decode): XLA:CPU widens the whole weight to float32 on every call; with a second,
            # zero row it takes its GEMM path, which reads the weight as it is
            two = jnp.concatenate([x.reshape(1, -1), jnp.zeros((1, x.shape[-1]), x.dtype)])
            return _dot_f32(two, w)[:1].reshape(*x.shape[:-1], w.shape[-1]).astype(out_dtype)
        return _dot_f32(x, w).astype(out_dtype)
    return _frozen_matmul_t(x, w, w_t, out_dtype)


def base_matmul(x, w, w_t=None, packed=None, out_dtype=None, dense_kernel: str = "", pad_one_row: bool = False):
    """`frozen_matmul`, or for a decode step's rows (x [b <= 64, 1, k] in the kernel's row dtype), and inside
    `native_prefill` a prefill's, of a weight packed for them (`native.dense.pack_dense`) the native product
    (host_kernels/csrc/xla_dense.c, on `dense_kernel`) on XLA:CPU. The float32 sums are XLA's up to summation order
    (quantized packings: the products of the quantized weights). Training never takes it: its rows have more than
    one position and it does not run under `native_prefill`."""
    y = native_product(x, packed, w.shape[-1], dense_kernel, out_dtype)
    return y if y is not None else frozen_matmul(x, w, w_t, out_dtype, pad_one_row)


def native_product(x, packed, n: int, dense_kernel: str, out_dtype=None):
    """x @ W (n columns, packed for `dense_kernel`) natively in `out_dtype` (default x's), or None where x's rows
    are not the kernel's (`base_matmul`'s rule) or nothing is packed."""
    if packed is None or not takes(dense_kernel, x, prefill=_NATIVE_PREFILL.get()):
        return None
    y = dense_call(x.reshape(-1, x.shape[-1]).astype(row_dtype(dense_kernel)), packed, n, dense_kernel)
    return y.reshape(*x.shape[:-1], n).astype(out_dtype or x.dtype)


def _dot_f32(x, w):
    return jnp.dot(x, w, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _frozen_matmul_t(x, w, w_t, out_dtype):
    return _dot_f32(x, w).astype(out_dtype)


def _frozen_matmul_t_fwd(x, w, w_t, out_dtype):
    return _frozen_matmul_t(x, w, w_t, out_dtype), (w, w_t)


def _frozen_matmul_t_bwd(out_dtype, residuals, g):
    w, w_t = residuals  # frozen: their cotangents are zeros that nothing reads
    return _dot_f32(g.astype(w_t.dtype), w_t).astype(w_t.dtype), jnp.zeros_like(w), jnp.zeros_like(w_t)


_frozen_matmul_t.defvjp(_frozen_matmul_t_fwd, _frozen_matmul_t_bwd)


def native_frozen_matmul(x, packed, packed_t, n: int, kernel: str, out_dtype=None):
    """x @ W for a frozen bfloat16 weight W [k, n] held packed for `kernel` twice, as `pack_dense(W)` and
    `pack_dense(W.T)`: the forward and the backward's input gradient g @ W.T both the native product
    (host_kernels/csrc/xla_dense.c), on XLA:CPU. x: bfloat16 [..., k]; the result in `out_dtype` (default x's).
    For a bfloat16 training step's head (`ExecutionPlan.training_head`), where XLA:CPU's own bfloat16 products ran
    slower, forward and backward alike."""
    return _native_frozen(x, packed, packed_t, n, kernel, jnp.dtype(out_dtype or x.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _native_frozen(x, packed, packed_t, n, kernel, out_dtype):
    y = dense_rows_call(x.reshape(-1, x.shape[-1]), packed, n, kernel)
    return y.reshape(*x.shape[:-1], n).astype(out_dtype)


def _native_frozen_fwd(x, packed, packed_t, n, kernel, out_dtype):
    return _native_frozen(x, packed, packed_t, n, kernel, out_dtype), (packed, packed_t, x.shape[-1])


def _native_frozen_bwd(n, kernel, out_dtype, residuals, g):
    packed, packed_t, k = residuals  # frozen weights: no cotangents
    dx = dense_rows_call(g.reshape(-1, n).astype(jnp.bfloat16), packed_t, k, kernel)
    return dx.reshape(*g.shape[:-1], k).astype(jnp.bfloat16), None, None


_native_frozen.defvjp(_native_frozen_fwd, _native_frozen_bwd)


class Projection(nnx.Module):
    """y = x @ W (+ b) (+ scale * dropout(x) @ A @ B when a LoRA adapter is attached, as peft computes it)."""

    def __init__(self, weight, bias=None, pad_one_row: bool = False):
        self.weight = Frozen(weight)
        self.pad_one_row = pad_one_row  # the plan's: a one-row bfloat16 product padded to two (`frozen_matmul`)
        self.weight_t = nnx.data(None)  # W transposed, while training in bfloat16 on a CPU (`frozen_matmul`)
        self.packed = nnx.data(None)  # W packed for decode steps' native product (`base_matmul`), once generating
        self.dense_kernel = ""  # the kernel that multiplies it (the plan's `dense_decode`)
        self.bias = Frozen(bias) if bias is not None else None
        self.lora_a = nnx.data(None)
        self.lora_b = nnx.data(None)
        self.lora_scale = 0.0
        self.lora_dropout = 0.0
        self.lora_index = 0  # distinct per adapter, so each draws its own dropout mask
        self.served = nnx.data(None)  # adapters chosen per request (model.served_adapters.ServedLoRA), if any

    def attach_lora(self, a_ir, b_ro, scale: float, dropout: float = 0.0, index: int = 0):
        self.lora_a = LoRAParam(a_ir)
        self.lora_b = LoRAParam(b_ro)
        self.lora_scale = float(scale)
        self.lora_dropout = float(dropout)
        self.lora_index = int(index)

    def keep_transposed(self):
        self.weight_t = Frozen(jnp.array(self.weight[...].T))

    def pack_for_decode(self, kernel: str, empty=None):
        self.packed = Frozen(pack_dense(self.weight[...], kernel, empty))
        self.dense_kernel = kernel

    def merged_weight(self):
        """W with the adapter folded in (W + scale * A @ B, float32 where an adapter is attached), for products
        that use the weight itself rather than x @ W (MLA's absorbed decode). No dropout: inference only."""
        w = self.weight[...]
        if self.lora_a is None:
            return w
        return w.astype(jnp.float32) + self.lora_scale * (self.lora_a[...] @ self.lora_b[...])

    def __call__(self, x):
        w_t = None if self.weight_t is None else self.weight_t[...]
        packed = None if self.packed is None else self.packed[...]
        y = base_matmul(x, self.weight[...], w_t, packed, dense_kernel=self.dense_kernel, pad_one_row=self.pad_one_row)
        return self.adapt(x, y)

    def adapt(self, x, y):
        """The base product y = x @ W (x's dtype) with the bias and the adapter's update added."""
        if self.bias is not None:
            y = y + self.bias[...]
        if self.lora_a is not None:
            x_in = x
            key = _DROPOUT_KEY.get()
            if key is not None and self.lora_dropout > 0:
                keep = 1.0 - self.lora_dropout
                mask = _dropout_mask(jax.random.fold_in(key, self.lora_index), keep, x.shape)
                x_in = jnp.where(mask, x / keep, 0).astype(x.dtype)
            a, b = self.lora_a[...], self.lora_b[...]  # float32; the update joins y in y's dtype
            y = y + (self.lora_scale * ((x_in.astype(a.dtype) @ a) @ b)).astype(y.dtype)
        if self.served is not None:
            update = self.served.update(x)
            if update is not None:
                y = y + update.astype(y.dtype)
        return y


class Attention(nnx.Module):
    """Causal grouped-query attention with RoPE, optional q/k RMSNorm (per head, or over the whole projection as
    OLMoE), optional q/k/v clipping, an optional sliding window and optional sinks (GPT-OSS: a learned logit per
    head that joins each softmax's denominator and attends to nothing) and an optional output gate (Qwen3-Next: q_proj
    gives each head's query and a gate beside it; the attention output is scaled by sigmoid(gate))."""

    def __init__(
        self,
        q,
        k,
        v,
        o,
        *,
        num_heads,
        num_kv_heads,
        head_dim,
        rope: Rope,
        eps,
        window=None,
        q_norm=None,
        k_norm=None,
        norm_whole_projection: bool = False,
        clip_qkv: float | None = None,
        native_cache_attention: bool = False,
        sinks=None,
        output_gate: bool = False,
        norm_unit_offset: bool = False,
    ):
        """`native_cache_attention` (the execution plan's choice, moe_jax/planning/plan.py): a generation step's
        attention over the cache (bfloat16 or float32), decode or prefill, runs as the native FFI call
        (host_kernels/csrc/xla_cache_attention.c). XLA's own path writes the cache by a select over all of it and
        attends every query to every cache entry under a mask; the native one reads only the keys a token sees."""
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = q, k, v, o
        self.q_norm = RMSNorm(q_norm, eps, norm_unit_offset) if q_norm is not None else None
        self.k_norm = RMSNorm(k_norm, eps, norm_unit_offset) if k_norm is not None else None
        self.output_gate = output_gate
        self.norm_whole_projection = norm_whole_projection
        self.clip_qkv = clip_qkv
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rope = rope
        self.window = window
        self.native_cache_attention = native_cache_attention
        self.sinks = Frozen(sinks) if sinks is not None else None
        # W_q | W_k | W_v packed as one weight for the native products (`pack_for_decode`): one call where three
        # each paid a call's fixed cost, large beside a small product's bytes
        self.qkv_packed = nnx.data(None)
        self.qkv_kernel = ""

    def pack_for_decode(self, kernel: str, empty=None):
        """Packs q, k and v's base weights side by side for `kernel` (in place of a packing of each)."""
        w = jnp.concatenate([p.weight[...] for p in (self.q_proj, self.k_proj, self.v_proj)], axis=1)
        self.qkv_packed = Frozen(pack_dense(w, kernel, empty))
        self.qkv_kernel = kernel

    def _qkv(self, x_btd):
        """q, k, v = the three projections of x: one native product of the packed W_q | W_k | W_v where it takes
        x's rows (then each projection's bias and adapter), else each projection on its own."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        widths = [p.weight[...].shape[-1] for p in projections]
        packed = None if self.qkv_packed is None else self.qkv_packed[...]
        y = native_product(x_btd, packed, sum(widths), self.qkv_kernel)
        if y is None:
            return tuple(p(x_btd) for p in projections)
        parts = jnp.split(y, [widths[0], widths[0] + widths[1]], axis=-1)
        return tuple(p.adapt(x_btd, part) for p, part in zip(projections, parts, strict=True))

    def _projections(self, x_btd):
        """q, k, v [b, t, heads, hd] token-major, normed and clipped as the family does, and the output gate
        [b, t, heads * hd] (None without one)."""
        b, t, _ = x_btd.shape
        q, k, v = self._qkv(x_btd)
        gate = None
        if self.output_gate:  # each head's query, then its gate
            q, gate = jnp.split(q.reshape(b, t, self.num_heads, 2 * self.head_dim), 2, axis=-1)
            q, gate = q.reshape(b, t, -1), gate.reshape(b, t, -1)
        if self.q_norm is not None and self.norm_whole_projection:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (jnp.clip(a, -self.clip_qkv, self.clip_qkv) for a in (q, k, v))
        hd = self.head_dim
        q, k, v = q.reshape(b, t, -1, hd), k.reshape(b, t, -1, hd), v.reshape(b, t, -1, hd)
        if self.q_norm is not None and not self.norm_whole_projection:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v, gate

    def __call__(self, x_btd, positions_bt, cache=None):
        """Returns (output [b, t, d], updated cache). `cache` is (k, v), each [b, kv, s, hd], or None.

        With a cache, this step's keys and values are written at `positions_bt` and every query attends to cache
        slots at positions up to its own: right-padded rows simply overwrite their padding later. The cache is
        kept kv-head-major, the layout the attention products read: token-major, XLA:CPU transposed (and
        widened) all of it before each product.
        """
        b, t, _ = x_btd.shape
        kv, hd = self.num_kv_heads, self.head_dim
        # RoPE token-major, then kv-head-major (queries [b, kv, t, group, hd], keys/values [b, kv, t, hd]). RoPE
        # after the transpose ran faster on XLA:CPU, but its fusion dropped bfloat16 roundings transformers makes,
        # moving bf16 logits several times further from transformers' than this order
        q, k, v, gate = self._projections(x_btd)
        q = q.reshape(b, t, kv, self.num_heads // kv, hd)
        v = v.transpose(0, 2, 1, 3)
        cos, sin = self.rope.cos_sin(positions_bt)
        q = self.rope.apply(q, cos[:, :, None, None], sin[:, :, None, None]).transpose(0, 2, 1, 3, 4)
        k = self.rope.apply(k, cos[:, :, None], sin[:, :, None]).transpose(0, 2, 1, 3)

        sinks = None if self.sinks is None else self.sinks[...].reshape(kv, -1)
        if cache is None:
            out = chunked_causal_attention(q, k, v, positions_bt, self.window, sinks_kg=sinks)
        else:
            k_cache, v_cache = cache
            if self.native_cache_attention:
                out, k_all, v_all = cache_attention_call(q, k, v, positions_bt, k_cache, v_cache, self.window)
            else:
                key_pos_bs = jnp.broadcast_to(jnp.arange(k_cache.shape[2]), (b, k_cache.shape[2]))
                k_all = write_positions(k_cache, k, positions_bt, key_pos_bs)
                v_all = write_positions(v_cache, v, positions_bt, key_pos_bs)
                out = attend(
                    q, k_all.astype(q.dtype), v_all.astype(q.dtype), positions_bt, key_pos_bs, self.window, None, sinks
                )
            cache = (k_all, v_all)
        # [b, kv, t, group, hd] -> [b, t, heads * hd]
        out = out.transpose(0, 2, 1, 3, 4).reshape(b, t, self.num_heads * hd)
        if gate is not None:
            out = out * jax.nn.sigmoid(gate)
        return self.o_proj(out), cache


QUERY_CHUNK = 64


def chunked_causal_attention(
    q_bktgd, k_bksd, v_bksd, positions_bt, window, scale=None, chunk: int = QUERY_CHUNK, sinks_kg=None, key_mask=None
):
    """Self-attention of a sequence on itself, `chunk` queries at a time, each against the keys it can see.
    Inputs and output in kv-head-major layout (`attend`); `key_mask` [b, t, t], the keys each query may see besides.

    Keys after a chunk's last query are skipped, as are keys a sliding window has left behind: this relies on
    positions increasing strictly along the sequence (true for whole sequences; the KV-cache path does not use
    this). Besides halving the work of a causal mask, the small score blocks stay in cache, forward and backward.
    """
    t = q_bktgd.shape[2]
    if t <= chunk:
        return attend(q_bktgd, k_bksd, v_bksd, positions_bt, positions_bt, window, scale, sinks_kg, key_mask)
    query_ranges, key_ranges = [], []
    for start in range(0, t, chunk):
        stop = min(start + chunk, t)
        query_ranges.append((start, stop))
        key_ranges.append((0 if window is None else max(0, start - window + 1), stop))
    query_ranges, key_ranges = tuple(query_ranges), tuple(key_ranges)
    outs = [
        attend(
            q,
            k,
            v,
            positions_bt[:, qa:qb],
            positions_bt[:, ka:kb],
            window,
            scale,
            sinks_kg,
            None if key_mask is None else key_mask[:, qa:qb, ka:kb],
        )
        for q, k, v, (qa, qb), (ka, kb) in zip(
            take_ranges(q_bktgd, query_ranges, 2),
            take_ranges(k_bksd, key_ranges, 2),
            take_ranges(v_bksd, key_ranges, 2),
            query_ranges,
            key_ranges,
            strict=True,
        )
    ]
    return jnp.concatenate(outs, axis=2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def take_ranges(x, ranges, axis):
    """The slices [a, b) of x along `axis` for each (a, b) in `ranges` (which together cover the axis). Its
    gradient is assembled segment by segment and concatenated: the default (each slice's cotangent padded to
    full size, then all summed) makes XLA:CPU evaluate every pad for every element, and the chunked attention
    backward spent much of its time there."""
    return tuple(jax.lax.slice_in_dim(x, a, b, axis=axis) for a, b in ranges)


def _take_ranges_fwd(x, ranges, axis):
    return take_ranges(x, ranges, axis), None


def _take_ranges_bwd(ranges, axis, _, cotangents):
    cuts = sorted({c for r in ranges for c in r})
    segments = []
    for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
        parts = [
            jax.lax.slice_in_dim(g, lo - a, hi - a, axis=axis)
            for (a, b), g in zip(ranges, cotangents, strict=True)
            if a <= lo and hi <= b
        ]
        segments.append(functools.reduce(jnp.add, parts))
    return (jnp.concatenate(segments, axis=axis),)


take_ranges.defvjp(_take_ranges_fwd, _take_ranges_bwd)


def write_positions(cache_bksd, new_bktd, positions_bt, key_pos_bs):
    """The cache with each row's new entries written at their positions (distinct within a row), by selects over
    the cache rather than a scatter: XLA:CPU has no bfloat16 scatter and widened the whole cache to float32 and
    back around one, twice per layer and step."""
    new_bktd = new_bktd.astype(cache_bksd.dtype)
    if new_bktd.shape[2] == 1:  # decode: one entry, broadcast along the cache
        return jnp.where((key_pos_bs == positions_bt)[:, None, :, None], new_bktd, cache_bksd)
    # the new entries moved to their cache positions by a one-hot product (exact: one term per position), which
    # XLA:CPU runs as a small GEMM; as a gather, fused with the RoPE before it, it took ~4x longer
    match_bst = key_pos_bs[:, :, None] == positions_bt[:, None, :]
    # (HIGHEST: an accelerator's default float32 product, TF32, would round the entries)
    moved = jnp.einsum(
        "bst,bktd->bksd",
        match_bst.astype(new_bktd.dtype),
        new_bktd,
        preferred_element_type=jnp.float32,
        precision=jax.lax.Precision.HIGHEST,
    )
    return jnp.where(match_bst.any(axis=2)[:, None, :, None], moved.astype(cache_bksd.dtype), cache_bksd)


def attend(q_bktgd, k_bksd, v_bksd, q_pos_bt, k_pos_bs, window, scale=None, sinks_kg=None, key_mask=None):
    """Grouped-query attention in kv-head-major layout: queries [b, kv, t, group, d], keys [b, kv, s, d], values
    [b, kv, s, dv]. The group's queries share their keys, so (t, group) is one matrix dimension: one GEMM per kv
    head. Scores are scaled by `scale` (default 1 / sqrt(d)); `sinks_kg`, each head's sink logit; `key_mask`
    [b, t, s], the keys each query may see besides causality and the window (a sparse attention's choice)."""
    b, kv, t, g, hd = q_bktgd.shape
    q = q_bktgd.reshape(b, kv, t * g, hd)
    # float32 accumulation: also the form XLA:CPU runs on its bfloat16 GEMM (see frozen_matmul)
    scores = jnp.einsum("bkmd,bksd->bkms", q, k_bksd, preferred_element_type=jnp.float32)
    scores = scores.reshape(b, kv, t, g, -1) * (hd**-0.5 if scale is None else scale)
    allowed = k_pos_bs[:, None, :] <= q_pos_bt[:, :, None]  # [b, t, s]
    if window is not None:
        allowed &= k_pos_bs[:, None, :] > q_pos_bt[:, :, None] - window
    if key_mask is not None:
        allowed &= key_mask
    scores = jnp.where(allowed[:, None, :, None], scores, jnp.finfo(jnp.float32).min)
    if sinks_kg is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:  # the softmax over the scores and the sink, the sink's share dropped
        sink = sinks_kg.astype(jnp.float32)[None, :, None, :, None]
        top = jax.lax.stop_gradient(jnp.maximum(jnp.max(scores, axis=-1, keepdims=True), sink))
        e = jnp.exp(scores - top)
        probs = e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - top))
    probs = probs.astype(q.dtype).reshape(b, kv, t * g, -1)
    out = jnp.einsum("bkms,bksd->bkmd", probs, v_bksd, preferred_element_type=jnp.float32)
    return out.astype(q.dtype).reshape(b, kv, t, g, v_bksd.shape[-1])


class SwiGLU(nnx.Module):
    """down(silu(gate(x)) * up(x)): the dense and shared-expert MLP."""

    def __init__(self, gate, up, down):
        self.gate_proj, self.up_proj, self.down_proj = gate, up, down

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
