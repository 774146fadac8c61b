"""The fine-tuning objective: next-token cross-entropy over masked positions, differentiated in the LoRA weights.

`lora_value_and_grad(model)` returns a function of (LoRA state, tokens [b, t], loss mask [b, t]) giving the mean
loss over masked target positions and its gradient for the LoRA parameters only: the base weights are a separate,
non-differentiated argument, so no gradient (nor optimizer state) is ever made for them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moe_jax.model.layers import lora_dropout_key
from moe_jax.model.lora import split_trainable


def causal_lm_loss(logits_btv, tokens_bt, mask_bt):
    """Mean cross-entropy of predicting tokens[:, 1:] from logits[:, :-1], over positions where mask[:, 1:]."""
    logp = jax.nn.log_softmax(logits_btv[:, :-1].astype(jnp.float32), axis=-1)
    target_logp = jnp.take_along_axis(logp, tokens_bt[:, 1:, None], axis=-1)[..., 0]
    mask = mask_bt[:, 1:].astype(jnp.float32)
    return -jnp.sum(target_logp * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def lora_value_and_grad(model):
    """(fn(lora_state, tokens, mask, dropout_key=None) -> (loss, grads), initial LoRA state).

    With a `dropout_key`, adapters with dropout draw their masks from it (training); without, none is applied.
    The frozen rest of the model is read from `model` at each call, so a device expert cache refreshed between
    steps is used at once; a change of structure (a resized cache) recompiles.
    """
    model.prepare_for_training()
    graphdef, lora_state, rest = split_trainable(model.transformer)
    compiled = {"graphdef": model.graphdef, "state": model.state, "step": _compile(graphdef), "rest": rest}

    def value_and_grad(lora_state, tokens_bt, mask_bt, dropout_key=None):
        if compiled["state"] is not model.state:  # split again only when the model changed
            graphdef, _, rest = split_trainable(model.transformer)
            if compiled["graphdef"] is not model.graphdef:
                compiled["step"] = _compile(graphdef)
            compiled.update(graphdef=model.graphdef, state=model.state, rest=rest)
        return compiled["step"](lora_state, compiled["rest"], tokens_bt, mask_bt, dropout_key)

    return value_and_grad, lora_state


def _compile(graphdef):
    def loss_fn(lora_state, rest, tokens_bt, mask_bt, dropout_key=None):
        positions = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
        with lora_dropout_key(dropout_key):
            logits, _ = nnx.merge(graphdef, lora_state, rest)(tokens_bt, positions)
        return causal_lm_loss(logits, tokens_bt, mask_bt)

    return jax.jit(jax.value_and_grad(loss_fn))
