"""What the planners know of a model: its experts' shape and expected routing (`Shape`), and the device work
of a whole step around them (`StepShape`), from its config."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Shape:
    layers: int
    experts: int
    top_k: int
    expert_params: int
    itemsize: int

    @property
    def expert_bytes(self) -> int:
        return self.expert_params * self.itemsize


def model_shape(config, itemsize: int) -> Shape:
    params = 3 * config.hidden_size * config.expert_intermediate_size
    return Shape(len(config.moe_layers), config.num_experts, config.num_experts_per_tok, params, itemsize)


def expected_routing(tokens: int, shape: Shape, zipf: float = 0.0) -> np.ndarray:
    """Rows per expert for `tokens` tokens routed top-k over experts of Zipf popularity: the expected counts
    rounded to whole rows that add up to tokens x top-k (largest remainders first), so a decode step of one
    token is top-k experts of one row each, not every expert with a fraction of a row."""
    popularity = 1.0 / np.arange(1, shape.experts + 1) ** zipf
    expected = tokens * shape.top_k * popularity / popularity.sum()
    rows = np.floor(expected)
    short = int(round(tokens * shape.top_k - rows.sum()))
    rows[np.argsort(-(expected - rows), stable=True)[:short]] += 1
    return rows


@dataclass(frozen=True)
class StepShape:
    experts: Shape  # the MoE layers' experts
    layers: int  # all decoder layers
    hidden: int
    device_params: int  # weights the device multiplies per token in an average layer (outside the routed experts)


def step_shape(config, itemsize: int) -> StepShape:
    d = config.hidden_size
    if config.mla is not None:
        m = config.mla
        q_heads = config.num_heads * (m.nope_dim + m.rope_dim)
        q_in = (d + q_heads) * m.q_lora_rank if m.q_lora_rank else d * q_heads
        kv = d * (m.kv_lora_rank + m.rope_dim) + m.kv_lora_rank * config.num_heads * (m.nope_dim + m.v_dim)
        attention = q_in + kv + config.num_heads * m.v_dim * d
        if m.indexer is not None:  # DeepSeek-V3.2's indexer: its queries, key and head weights
            attention += (m.q_lora_rank * m.indexer.num_heads + d) * m.indexer.head_dim + d * m.indexer.num_heads
    else:
        hd = config.head_dim
        gate = 2 if config.attention_output_gate else 1  # q_proj also gives the output gate
        attention = (1 + gate) * d * config.num_heads * hd + 2 * d * config.num_kv_heads * hd
    if config.linear_layers:  # an average layer's mixer: the DeltaNet's projections in its share of the layers
        s = config.linear_attention
        delta_net = d * (2 * s.key_dim + 3 * s.value_dim + 2 * s.num_v_heads)
        linear = len(config.linear_layers)
        attention = (attention * (config.num_layers - linear) + delta_net * linear) / config.num_layers
    moe = len(config.moe_layers)
    dense_mlp = (config.num_layers - moe) * 3 * d * config.dense_intermediate_size
    shared = moe * 3 * d * config.shared_expert_intermediate_size
    per_layer = attention + (dense_mlp + shared) / config.num_layers
    return StepShape(model_shape(config, itemsize), config.num_layers, d, int(per_layer))
