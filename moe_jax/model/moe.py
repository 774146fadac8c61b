"""The mixture-of-experts block: router, top-k, an expert backend, optional shared expert.

The expert backend is the only part that differs between placements (device, host, offload, hybrid); every
backend is a callable `(x_td, expert_ids_tk, weights_tk) -> y_td` computing
y_t = sum_k weights_tk * down_e(glu(gate_e(x_t), up_e(x_t))) with e = expert_ids_tk: glu is silu(g) * u, or the
family's (`host_kernels.activations.GLU`), and gate_e / up_e may carry biases (GPT-OSS). The down projection's
bias is added here, by the block, whatever the backend: sum_k weights_tk * b_down[e].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from host_kernels import GLU, SWIGLU
from moe_jax.model.config import Router
from moe_jax.model.layers import Frozen, SwiGLU, lora_arrays, native_product
from moe_jax.native.dense import pack_dense, row_dtype


def route(x_td, router_de, spec: Router, bias_e=None, logits_te=None):
    """(weights [t, k] float32, expert ids [t, k]) as each family's TopKRouter in transformers (see `Router`), from
    the router's logits `logits_te` where they were computed already (float32), else from x and the router."""
    if logits_te is not None:
        logits = logits_te
    elif spec.float32_logits:
        logits = x_td.astype(jnp.float32) @ router_de.astype(jnp.float32)
    else:
        logits = (x_td @ router_de).astype(jnp.float32)
    if spec.scores == "topk_softmax":  # GPT-OSS: `bias_e` is the Linear's bias; the chosen logits softmaxed
        if bias_e is not None:
            logits = logits + bias_e.astype(jnp.float32)
        chosen_tk, ids_tk = jax.lax.top_k(logits, spec.top_k)
        return jax.nn.softmax(chosen_tk, axis=-1), ids_tk
    scores = jax.nn.softmax(logits, axis=-1) if spec.scores == "softmax" else jax.nn.sigmoid(logits)
    choice = scores if bias_e is None else scores + bias_e.astype(jnp.float32)
    if spec.groups > 1:
        allowed = _allowed_groups(choice, spec)
        # DeepSeek-V2 zeroes the other groups' softmax scores (and weights); V3 / GLM exclude them from the choice
        scores = jnp.where(allowed, scores, 0.0) if spec.scores == "softmax" else scores
        choice = jnp.where(allowed, choice, 0.0 if spec.scores == "softmax" else -jnp.inf)
    ids_tk = jax.lax.top_k(choice, spec.top_k)[1]
    weights_tk = jnp.take_along_axis(scores, ids_tk, axis=-1)
    if spec.norm_topk_prob:
        weights_tk = weights_tk / jnp.sum(weights_tk, axis=-1, keepdims=True)
    return weights_tk * spec.scale if spec.scale != 1.0 else weights_tk, ids_tk


def _allowed_groups(choice_te, spec: Router):
    """[t, e] mask of the experts in each token's `topk_groups` best groups."""
    t, e = choice_te.shape
    grouped = choice_te.reshape(t, spec.groups, e // spec.groups)
    if spec.group_score == "max":
        group_scores = jnp.max(grouped, axis=-1)
    else:  # "top2": the sum of each group's best two
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
    best = jax.lax.top_k(group_scores, spec.topk_groups)[1]
    chosen_tg = jnp.any(jax.nn.one_hot(best, spec.groups, dtype=jnp.bool_), axis=1)
    return jnp.repeat(chosen_tg, e // spec.groups, axis=1)


def sort_pairs_by_expert(ids_tk, num_experts: int):
    """Orders the (token, slot) pairs by expert: returns (order [p], token index [p], group sizes [e])."""
    flat = ids_tk.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token_of_pair = order // ids_tk.shape[1]
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return order, token_of_pair, group_sizes


def glu(gate, up, spec: GLU):
    """The experts' gated activation (`GLU`), in the inputs' dtype."""
    if spec.kind == "swiglu":
        return jax.nn.silu(gate) * up
    gate = jnp.minimum(gate, spec.limit)
    up = jnp.clip(up, -spec.limit, spec.limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * spec.alpha))


def _swiglu(x, w13, w2, dot, lora: dict, scale: float, spec: GLU = SWIGLU, b13=None):
    """The gated MLP with `dot(lhs, rhs)` as the product (grouped or dense), activation `spec`, optional gate/up
    biases `b13` (a row [2f] or one per row [rows, 2f]) and optional LoRA on its three projections."""

    def adapter(name, inputs):
        return scale * dot(dot(inputs, lora[f"{name}_a"]), lora[f"{name}_b"])

    h = dot(x, w13)
    if b13 is not None:
        h = h + b13.astype(h.dtype)
    f = w2.shape[-2]
    gate, up = h[:, :f], h[:, f:]
    if "gate_a" in lora:
        gate = gate + adapter("gate", x)
    if "up_a" in lora:
        up = up + adapter("up", x)
    act = glu(gate, up, spec)
    out = dot(act, w2)
    if "down_a" in lora:
        out = out + adapter("down", act)
    return out


def grouped_swiglu(x_pd, w13_edf2, w2_efd, group_sizes_e, lora=None, scale=0.0, spec: GLU = SWIGLU, b13_pf2=None):
    """The gated MLP over expert-sorted rows with `ragged_dot`: no capacity, no dropped tokens.

    `lora` optionally maps gate_a/gate_b/up_a/up_b/down_a/down_b to per-expert adapters ([e, in, r], [e, r, out]);
    `b13_pf2`: each row's expert's gate/up biases.
    """

    def ragged_dot(lhs, rhs):  # float32 accumulation, the result in the inputs' dtype (as frozen_matmul)
        out = jax.lax.ragged_dot(lhs, rhs, group_sizes_e, preferred_element_type=jnp.float32)
        return out.astype(jnp.result_type(lhs, rhs))

    return _swiglu(x_pd, w13_edf2, w2_efd, ragged_dot, lora or {}, scale, spec, b13_pf2)


def dense_swiglu(x_td, w13_df2, w2_fd, lora=None, scale=0.0, spec: GLU = SWIGLU, b13_f2=None):
    """One expert's gated MLP over every row of x, float32 accumulation (as grouped_swiglu); `lora` as there, with
    this expert's adapters ([in, r], [r, out]); `b13_f2` its gate/up biases."""

    def dot(lhs, rhs):
        return jnp.dot(lhs, rhs, preferred_element_type=jnp.float32).astype(jnp.result_type(lhs, rhs))

    return _swiglu(x_td, w13_df2, w2_fd, dot, lora or {}, scale, spec, b13_f2)


def subset_experts(
    x_td,
    ids_tk,
    weights_tk,
    slot_experts,
    w13_slots,
    w2_slots,
    num_experts: int,
    lora=None,
    scale=0.0,
    spec: GLU = SWIGLU,
    b13_ef2=None,
):
    """Output of the pairs routed to a subset of experts held in slots; every other pair contributes zero.

    `slot_experts[s]` is the global id of the expert whose weights are `w13_slots[s]`, `w2_slots[s]` (separate
    arrays, one per slot; num_experts marks an empty slot). `lora` holds adapters for all experts ([e, ...]), as
    `b13_ef2` their gate/up biases.
    Slot by slot: a slot no pair routes to costs a skipped `cond`, one that some do costs one dense SwiGLU over the
    call's rows (their routing weights zero for the rows routed elsewhere). So a decode step pays for the experts
    it routes to, where `ragged_dot` on XLA:CPU computes every group for every row, and separate arrays let each
    product read its weights in place where slicing a stacked array would copy them first.
    """
    slots = len(w13_slots)
    slot_of_expert = (
        jnp.full(num_experts + 1, slots, jnp.int32).at[slot_experts].set(jnp.arange(slots, dtype=jnp.int32))
    )
    local_tk = slot_of_expert[ids_tk]
    y = jnp.zeros_like(x_td)
    for s in range(slots):
        routed = local_tk == s
        gate_t = jnp.sum(jnp.where(routed, weights_tk, 0), axis=1).astype(x_td.dtype)
        expert = jnp.minimum(slot_experts[s], num_experts - 1)
        slot_lora = {name: a[expert] for name, a in lora.items()} if lora else None

        b13 = None if b13_ef2 is None else b13_ef2[expert]

        def compute(w13=w13_slots[s], w2=w2_slots[s], gate_t=gate_t, slot_lora=slot_lora, b13=b13):
            return dense_swiglu(x_td, w13, w2, slot_lora, scale, spec, b13) * gate_t[:, None]

        y = y + jax.lax.cond(jnp.any(routed), compute, lambda: jnp.zeros_like(x_td))
    return y


class DeviceExperts(nnx.Module):
    """All experts resident in accelerator memory; the pure-JAX reference for every other backend."""

    def __init__(self, w13_edf2, w2_efd, spec: GLU = SWIGLU, b13_ef2=None):
        self.w13 = Frozen(w13_edf2)
        self.w2 = Frozen(w2_efd)
        self.spec = spec
        self.b13 = Frozen(b13_ef2) if b13_ef2 is not None else None
        self.lora_scale = 0.0
        self.lora = nnx.data(None)  # nnx.Dict of LoRAParam when adapters are attached (see moe_jax.model.lora)

    def __call__(self, x_td, ids_tk, weights_tk):
        num_experts = self.w13.shape[0]
        order, token_of_pair, group_sizes = sort_pairs_by_expert(ids_tk, num_experts)
        lora = lora_arrays(self.lora)
        b13 = None if self.b13 is None else self.b13[...][ids_tk.reshape(-1)[order]]
        out_pd = grouped_swiglu(
            x_td[token_of_pair], self.w13[...], self.w2[...], group_sizes, lora, self.lora_scale, self.spec, b13
        )
        weight_p = weights_tk.reshape(-1)[order].astype(out_pd.dtype)
        return jnp.zeros_like(x_td).at[token_of_pair].add(out_pd * weight_p[:, None])


class MoEBlock(nnx.Module):
    def __init__(
        self,
        router_de,
        experts,
        *,
        spec: Router,
        router_bias_e=None,
        shared: SwiGLU | None = None,
        shared_gate_d1=None,
        down_bias_ed=None,
    ):
        """`router_bias_e`: the routing correction bias (DeepSeek-V3), or the router's own bias (GPT-OSS), as
        `spec` says; `down_bias_ed`: the experts' down-projection biases (GPT-OSS)."""
        self.router = Frozen(router_de)
        self.router_packed = nnx.data(None)  # the router packed for the native product (`pack_for_decode`)
        self.router_kernel = ""
        self.router_bias = Frozen(router_bias_e) if router_bias_e is not None else None
        self.experts = experts
        self.spec = spec
        self.shared = shared
        self.shared_gate = Frozen(shared_gate_d1) if shared_gate_d1 is not None else None
        self.down_bias = Frozen(down_bias_ed) if down_bias_ed is not None else None

    def __call__(self, x_btd):
        x_td, ids_tk, weights_tk = self._route(x_btd)
        y_td = self.experts(x_td, ids_tk, weights_tk)
        beside = self._beside_experts(x_td, ids_tk, weights_tk)
        if beside is not None:
            y_td = y_td + beside
        return y_td.reshape(x_btd.shape)

    # --- pipelined (Transformer.pipelined): the experts of one micro-batch started, finished after other work
    def start(self, x_btd, chain, micro_batch: int, opens: bool = False):
        """Routes and starts the experts (experts with a `start`, the host's, run meanwhile; others compute now)
        and computes the shared expert; returns (what `finish` takes, chain)."""
        x_td, ids_tk, weights_tk = self._route(x_btd)
        if hasattr(self.experts, "start"):
            pending, chain = self.experts.start(x_td, ids_tk, weights_tk, chain, micro_batch, opens)
        else:
            pending = self.experts(x_td, ids_tk, weights_tk)
        return (pending, self._beside_experts(x_td, ids_tk, weights_tk), x_btd.shape), chain

    def finish(self, started, chain, closes: bool = False):
        pending, beside_td, shape = started
        if hasattr(self.experts, "finish"):
            y_td, chain = self.experts.finish(pending, chain, closes)
        else:
            y_td = pending
        if beside_td is not None:
            y_td = y_td + beside_td
        return y_td.reshape(shape), chain

    def pack_for_decode(self, kernel_for, empty=None):
        """Packs the router for generation's native dense products on `kernel_for(dtype)` (the plan's
        `router_kernel`), in the dtype its logits are computed in (float32 where the family computes them from
        float32 inputs). In XLA a bfloat16 router was widened to float32 inside every decode step (a loop-carried
        weight is not hoisted)."""
        dtype = jnp.float32 if self.spec.float32_logits else self.router[...].dtype
        kernel = kernel_for(dtype)
        if kernel and self.router_packed is None:
            self.router_packed = Frozen(pack_dense(self.router[...], kernel, empty))
            self.router_kernel = kernel

    def _route(self, x_btd):
        """(x [b*t, d], expert ids [b*t, k], routing weights [b*t, k] in x's dtype)"""
        b, t, d = x_btd.shape
        x_td = x_btd.reshape(b * t, d)
        bias = None if self.router_bias is None else self.router_bias[...]
        weights_tk, ids_tk = route(x_td, self.router[...], self.spec, bias, self._native_logits(x_btd))
        return x_td, ids_tk, weights_tk.astype(x_td.dtype)

    def _native_logits(self, x_btd):
        """The router's logits [b*t, e] in float32 from its packed copy, rounded as `route` rounds them (to x's
        dtype, or none for float32 inputs); None where it is not packed or the kernel does not take these rows."""
        if self.router_packed is None:
            return None
        n = self.router[...].shape[1]
        y = native_product(x_btd.astype(row_dtype(self.router_kernel)), self.router_packed[...], n, self.router_kernel)
        return None if y is None else y.reshape(-1, n).astype(jnp.float32)

    def _beside_experts(self, x_td, ids_tk, weights_tk):
        """What the block adds to the routed experts' sum: the shared expert and the routed experts' down biases
        weighted as their outputs are (None where neither)."""
        extra = None
        if self.shared is not None:
            extra = self.shared(x_td)
            if self.shared_gate is not None:
                extra = jax.nn.sigmoid(x_td @ self.shared_gate[...]) * extra
        if self.down_bias is not None:
            biases = jnp.einsum("tk,tkd->td", weights_tk, self.down_bias[...][ids_tk].astype(weights_tk.dtype))
            extra = biases if extra is None else extra + biases
        return extra
