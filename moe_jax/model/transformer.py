"""The decoder-only MoE transformer as an NNX module tree, built from named weights.

`build_transformer` takes a function that returns a dense weight by its Hugging Face name (already in `x @ W`
layout) and a function that returns the expert backend of a layer, so the same tree serves every checkpoint format
and every expert placement.
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
from flax import nnx

from moe_jax.formats import hf_names
from moe_jax.model.config import ModelConfig
from moe_jax.model.delta_net import GatedDeltaNet, GatedRMSNorm, input_projections
from moe_jax.model.layers import (
    Attention,
    Frozen,
    Projection,
    RMSNorm,
    SwiGLU,
    base_matmul,
    micro_batch_rows,
    native_frozen_matmul,
)
from moe_jax.model.mla import MLAttention
from moe_jax.model.moe import MoEBlock
from moe_jax.model.sparse_indexer import LightningIndexer
from moe_jax.native.dense import huge_page_packing, pack_dense
from moe_jax.planning.plan import ExecutionPlan


class DecoderLayer(nnx.Module):
    def __init__(self, attn, mlp, input_norm: RMSNorm, post_attn_norm: RMSNorm):
        """`attn`: the token mixer (Attention, MLAttention or GatedDeltaNet), held under its Hugging Face name
        (adapters are exported by module path)."""
        if isinstance(attn, GatedDeltaNet):
            self.linear_attn = attn
        else:
            self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = input_norm
        self.post_attention_layernorm = post_attn_norm

    def __call__(self, x_btd, positions_bt, cache=None, only_b=None):
        """`only_b` (a position per row): the output of those positions only, [b, 1, d] (the MLP skips the rest)."""
        h_btd, normed_btd, cache = self.attend(x_btd, positions_bt, cache)
        if only_b is not None:
            h_btd, normed_btd = at_positions(h_btd, only_b), at_positions(normed_btd, only_b)
        return h_btd + self.mlp(normed_btd), cache

    @property
    def mixer(self):
        return self.linear_attn if hasattr(self, "linear_attn") else self.self_attn

    def attend(self, x_btd, positions_bt, cache=None):
        """(x + attention, its normed form that the MLP takes, the updated cache)"""
        attn_out, cache = self.mixer(self.input_layernorm(x_btd), positions_bt, cache)
        x_btd = x_btd + attn_out
        return x_btd, self.post_attention_layernorm(x_btd), cache

    # --- pipelined (Transformer.pipelined): the MLP started, and finished after other micro-batches' work
    def start_mlp(self, normed_btd, chain, micro_batch: int, opens: bool):
        if isinstance(self.mlp, MoEBlock):
            return self.mlp.start(normed_btd, chain, micro_batch, opens)
        return self.mlp(normed_btd), chain

    def finish_mlp(self, h_btd, started, chain, closes: bool):
        if isinstance(self.mlp, MoEBlock):
            y_btd, chain = self.mlp.finish(started, chain, closes)
        else:
            y_btd = started
        return h_btd + y_btd, chain


class Transformer(nnx.Module):
    def __init__(
        self,
        config: ModelConfig,
        embed_vd,
        layers: list[DecoderLayer],
        final_norm: RMSNorm,
        lm_head_dv,
        micro_batches: int = 1,
        decode_micro_batches: int = 1,
        pad_one_row: bool = False,
    ):
        self.config = config
        # rows split into this many micro-batches that ping-pong between the device and the host (the plan's)
        self.micro_batches = micro_batches
        self.decode_micro_batches = decode_micro_batches  # ... for steps of one token a row
        self.pad_one_row = pad_one_row  # the plan's (layers.frozen_matmul)
        self.embed = Frozen(embed_vd)
        self.layers = nnx.List(layers)
        self.norm = final_norm
        self.lm_head = Frozen(lm_head_dv) if lm_head_dv is not None else None
        # while training in bfloat16 on a CPU (layers.frozen_matmul): the head's transpose — lm_head.T, or for a
        # tied head the embedding's transpose, which is then the head itself
        self.head_copy = nnx.data(None)
        # ... or, where the plan's `training_head` names a native kernel, the head and its transpose packed for it
        # (layers.native_frozen_matmul)
        self.training_head = nnx.data(None)
        self.training_head_t = nnx.data(None)
        self.training_kernel = ""
        self.head_packed = nnx.data(None)  # the head packed for decode steps' native product (layers.base_matmul)
        self.dense_kernel = ""  # the kernel that multiplies it

    def keep_transposed_weights(self, head_kernel: str = ""):
        """Holds transposed copies of the base weights for a faster bfloat16 backward (layers.frozen_matmul); the
        head's, with `head_kernel`, packed for that native kernel with the head itself (native_frozen_matmul)."""
        for _, module in nnx.iter_modules(self):
            if isinstance(module, Projection) and module.weight_t is None:
                module.keep_transposed()
        head = self.lm_head[...] if self.lm_head is not None else self.embed[...].T
        if head_kernel and self.training_head is None:
            self.training_head = Frozen(pack_dense(head, head_kernel))
            self.training_head_t = Frozen(pack_dense(head.T, head_kernel))
            self.training_kernel = head_kernel
        elif not head_kernel and self.head_copy is None:
            self.head_copy = Frozen(jnp.array(head.T))

    def pack_for_decode(self, kernel: str, router_kernel):
        """Packed copies of the dense weights that decode steps multiply natively (layers.base_matmul), the routers
        too (MoEBlock.pack_for_decode); made once, when the model first generates, where the plan says so
        (`ExecutionPlan.dense_decode`), side by side on huge pages."""
        empty = huge_page_packing()
        fused = set()  # attention's q, k and v: packed together (Attention.pack_for_decode)
        for _, module in nnx.iter_modules(self):
            if isinstance(module, Attention):
                if module.qkv_packed is None:
                    module.pack_for_decode(kernel, empty)
                fused.update(id(p) for p in (module.q_proj, module.k_proj, module.v_proj))
        for _, module in nnx.iter_modules(self):
            if isinstance(module, Projection) and module.packed is None and id(module) not in fused:
                module.pack_for_decode(kernel, empty)
            if isinstance(module, MoEBlock):
                module.pack_for_decode(router_kernel, empty)  # by its logits' float dtype, never quantized
        self.dense_kernel = kernel
        if self.head_packed is None:
            head = self.lm_head[...] if self.lm_head is not None else self.embed[...].T
            self.head_packed = Frozen(pack_dense(head, kernel, empty))

    def __call__(self, tokens_bt, positions_bt, caches=None, last_b=None):
        """Logits [b, t, vocab] in float32, and the updated per-layer KV caches (None without caches).

        With `last_b` (one position index per row), logits [b, 1, vocab] of those positions only: a prefill needs
        just the next-token logits. The last layer's MLP then runs on those positions only too (the other
        positions' outputs of the last layer feed nothing; llama.cpp skips them alike).
        """
        micro_batches = self.decode_micro_batches if tokens_bt.shape[1] == 1 else self.micro_batches
        if min(micro_batches, tokens_bt.shape[0]) > 1:
            x, new_caches = self.pipelined(tokens_bt, positions_bt, caches, micro_batches, last_b)
        else:
            x = self.embed[...][tokens_bt]
            new_caches = [] if caches is not None else None
            for i, layer in enumerate(self.layers):
                only_b = last_b if i == len(self.layers) - 1 else None
                x, cache = layer(x, positions_bt, None if caches is None else caches[i], only_b)
                if new_caches is not None:
                    new_caches.append(cache)
        return self.head(x), new_caches

    def pipelined(self, tokens_bt, positions_bt, caches=None, micro_batches: int = 2, last_b=None):
        """The layers over micro-batches of rows in ping-pong (backends/pipeline.py): each micro-batch's host
        experts are started after its attention and finished just before its next attention, so while the host
        computes one micro-batch's experts the device computes the others' attention. Same results as the plain
        pass (each row's arithmetic is unchanged); returns (the last hidden states, of `last_b`'s positions only
        where given, and the updated caches)."""
        parts = [slice(a, b) for a, b in micro_batch_bounds(tokens_bt.shape[0], micro_batches)]
        moe = [i for i, layer in enumerate(self.layers) if isinstance(layer.mlp, MoEBlock)]
        chain = jnp.zeros((), jnp.float32)
        xs = [self.embed[...][tokens_bt[p]] for p in parts]
        started: list = [None] * len(parts)
        new_caches = [] if caches is not None else None
        last_finish = (moe[-1], len(parts) - 1) if moe else None  # the pass's last finish (for the timeline)
        for i, layer in enumerate(self.layers):
            layer_caches = []
            for m, rows in enumerate(parts):
                if i:  # the previous layer's MLP of this micro-batch, started one round ago
                    closes = (i - 1, m) == last_finish
                    xs[m], chain = self.layers[i - 1].finish_mlp(*started[m], chain, closes=closes)
                cache = None if caches is None else tuple(c[rows] for c in caches[i])
                with micro_batch_rows(rows.start, rows.stop, tokens_bt.shape[0]):
                    h, normed, cache = layer.attend(xs[m], positions_bt[rows], cache)
                    if last_b is not None and i == len(self.layers) - 1:  # as in the plain pass
                        h, normed = at_positions(h, last_b[rows]), at_positions(normed, last_b[rows])
                    mlp, chain = layer.start_mlp(normed, chain, m, opens=bool(moe) and (i, m) == (moe[0], 0))
                started[m] = (h, mlp)
                layer_caches.append(cache)
            if new_caches is not None:  # each micro-batch's rows written back into the whole cache
                new_caches.append(
                    tuple(
                        _write_rows(whole, [cache[j] for cache in layer_caches], parts)
                        for j, whole in enumerate(caches[i])
                    )
                )
        last = len(self.layers) - 1
        for m in range(len(parts)):
            xs[m], chain = self.layers[last].finish_mlp(*started[m], chain, closes=(last, m) == last_finish)
        return jnp.concatenate(xs, axis=0), new_caches

    def head(self, x):
        """Logits in float32 of hidden states [b, t, d]."""
        x = self.norm(x)
        vocab = self.lm_head.shape[-1] if self.lm_head is not None else self.embed.shape[0]
        if self.training_head is not None and x.shape[1] > 1 and x.dtype == jnp.bfloat16:  # a training step's rows
            head, head_t = self.training_head[...], self.training_head_t[...]
            return native_frozen_matmul(x, head, head_t, vocab, self.training_kernel, out_dtype=jnp.float32)
        copy = None if self.head_copy is None else self.head_copy[...]
        if self.lm_head is not None:
            head, head_t = self.lm_head[...], copy
        else:
            head, head_t = (self.embed[...].T, None) if copy is None else (copy, self.embed[...])
        packed = None if self.head_packed is None else self.head_packed[...]
        kernel = self.dense_kernel
        return base_matmul(x, head, head_t, packed, jnp.float32, dense_kernel=kernel, pad_one_row=self.pad_one_row)


def at_positions(x_btd, positions_b):
    """x at one position per row: [b, 1, d]."""
    return x_btd[jnp.arange(x_btd.shape[0]), positions_b][:, None]


def micro_batch_bounds(rows: int, micro_batches: int) -> list[tuple[int, int]]:
    """[start, stop) of each micro-batch: `rows` split into at most `micro_batches` parts, the larger first."""
    count = max(1, min(micro_batches, rows))
    sizes = [rows // count + (m < rows % count) for m in range(count)]
    starts = [sum(sizes[:m]) for m in range(count)]
    return [(a, a + n) for a, n in zip(starts, sizes, strict=True)]


def _write_rows(whole, parts: list, bounds: list[slice]):
    """`whole` with each part written at its rows (in place where XLA may: the step donates its caches)."""
    for part, rows in zip(parts, bounds, strict=True):
        whole = whole.at[rows].set(part)
    return whole


def build_transformer(
    config: ModelConfig,
    dense: Callable[[str], object],
    experts_for_layer: Callable[[int], object],
    has: Callable[[str], bool],
    plan: ExecutionPlan,
) -> Transformer:
    """Assembles the module tree. `dense(name)` returns a weight in `x @ W` layout; `has(name)` says if it exists;
    `plan` says which parts run natively."""
    eps = config.rms_norm_eps

    def proj(name, bias: bool = False):
        return Projection(dense(f"{name}.weight"), dense(f"{name}.bias") if bias else None, plan.pad_one_row)

    def swiglu(prefix):
        return SwiGLU(*(proj(f"{prefix}.{p}_proj") for p in ("gate", "up", "down")))

    def norm(name):
        return RMSNorm(dense(f"{name}.weight"), eps, config.norm_unit_offset)

    layers = []
    for i in range(config.num_layers):
        p = hf_names.layer(i)
        if config.is_linear_layer(i):
            attn = _delta_net(config, i, proj, dense)
        elif config.mla:
            attn = _mla(config, hf_names.attention(i), proj, norm, dense, plan)
        else:
            attn = _gqa(config, i, proj, dense, plan)
        if config.is_moe_layer(i):
            moe_prefix = hf_names.moe_block(config, i)
            shared = swiglu(hf_names.shared_expert(config, i)) if config.shared_expert_intermediate_size else None
            gate_name = f"{moe_prefix}.shared_expert_gate.weight"
            router = hf_names.router(config, i)
            if config.router.logit_bias:
                router_bias = dense(f"{router}.bias")
            else:
                router_bias = dense(hf_names.router_bias(config, i)) if config.router.bias else None
            mlp = MoEBlock(
                dense(f"{router}.weight"),
                experts_for_layer(i),
                spec=config.router,
                router_bias_e=router_bias,
                shared=shared,
                shared_gate_d1=dense(gate_name) if shared is not None and config.shared_expert_gated else None,
                down_bias_ed=dense(hf_names.expert_biases(config, i)[1]) if config.expert_bias else None,
            )
        else:
            mlp = swiglu(f"{p}.{hf_names.DENSE_MLP}")
        layers.append(DecoderLayer(attn, mlp, norm(f"{p}.input_layernorm"), norm(f"{p}.post_attention_layernorm")))
    tied = config.tie_word_embeddings or not has(hf_names.LM_HEAD)
    return Transformer(
        config,
        dense(hf_names.EMBED),
        layers,
        norm(hf_names.FINAL_NORM),
        None if tied else dense(hf_names.LM_HEAD),
        micro_batches=plan.micro_batches,
        decode_micro_batches=plan.decode_micro_batches,
        pad_one_row=plan.pad_one_row,
    )


def _gqa(config: ModelConfig, layer: int, proj, dense, plan: ExecutionPlan) -> Attention:
    p = hf_names.attention(layer)
    return Attention(
        proj(f"{p}.q_proj", config.qkv_bias),
        proj(f"{p}.k_proj", config.qkv_bias),
        proj(f"{p}.v_proj", config.qkv_bias),
        proj(f"{p}.o_proj", config.o_bias),
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        rope=config.rope,
        eps=config.rms_norm_eps,
        window=config.sliding_windows[layer],
        q_norm=dense(f"{p}.q_norm.weight") if config.qk_norm else None,
        k_norm=dense(f"{p}.k_norm.weight") if config.qk_norm else None,
        norm_whole_projection=config.qk_norm == "full",
        clip_qkv=config.clip_qkv,
        native_cache_attention=plan.cache_attention,
        sinks=dense(f"{p}.sinks") if config.attention_sinks else None,
        output_gate=config.attention_output_gate,
        norm_unit_offset=config.norm_unit_offset,
    )


def _delta_net(config: ModelConfig, layer: int, proj, dense) -> GatedDeltaNet:
    p = hf_names.linear_attention(layer)
    return GatedDeltaNet(
        {name: proj(f"{p}.{name}") for name in input_projections(config.linear_attention)},
        dense(f"{p}.conv1d.weight"),
        dense(f"{p}.dt_bias"),
        dense(f"{p}.A_log"),
        GatedRMSNorm(dense(f"{p}.norm.weight"), config.rms_norm_eps),
        proj(f"{p}.out_proj"),
        spec=config.linear_attention,
    )


def _mla(config: ModelConfig, p: str, proj, norm, dense, plan: ExecutionPlan) -> MLAttention:
    low_rank_q = config.mla.q_lora_rank > 0
    indexer = None
    if config.mla.indexer is not None:
        indexer = LightningIndexer(
            proj(f"{p}.indexer.wq_b"),
            proj(f"{p}.indexer.wk"),
            dense(f"{p}.indexer.k_norm.weight"),
            dense(f"{p}.indexer.k_norm.bias"),
            dense(f"{p}.indexer.weights_proj.weight", jnp.float32),
            spec=config.mla.indexer,
            rope=config.rope,
        )
    return MLAttention(
        q_proj=None if low_rank_q else proj(f"{p}.q_proj"),
        q_a_proj=proj(f"{p}.q_a_proj", config.qkv_bias) if low_rank_q else None,
        q_a_layernorm=norm(f"{p}.q_a_layernorm") if low_rank_q else None,
        q_b_proj=proj(f"{p}.q_b_proj") if low_rank_q else None,
        kv_a_proj_with_mqa=proj(f"{p}.kv_a_proj_with_mqa", config.qkv_bias),
        kv_a_layernorm=norm(f"{p}.kv_a_layernorm"),
        kv_b_proj=proj(f"{p}.kv_b_proj"),
        o_proj=proj(f"{p}.o_proj", config.o_bias),
        num_heads=config.num_heads,
        mla=config.mla,
        rope=config.rope,
        scale=config.softmax_scale,
        absorbed_decode=plan.mla_decode != "expanded",
        indexer=indexer,
    )
