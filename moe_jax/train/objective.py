"""The fine-tuning objective: next-token cross-entropy over masked positions, differentiated in the LoRA weights.

How it works and why: docs/INTERNALS.md, moe_jax/train/objective.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moe_jax import distributed
from moe_jax.backends.expert_parallel import ROWS, SAME, over_processes
from moe_jax.compile_memory import keep_step_buffers
from moe_jax.model.layers import lora_dropout_key
from moe_jax.model.lora import split_trainable


def causal_lm_loss(logits_btv, tokens_bt, mask_bt):
    """Mean cross-entropy of predicting tokens[:, 1:] from logits[:, :-1], over positions where mask[:, 1:].

    Written as logsumexp minus the target's logit, picked by a compare-and-select over the vocabulary, on every
    position (the last one masked out): its gradient is then elementwise work XLA fuses. log_softmax with
    take_along_axis and a slice of the logits cost a zero-filled [t, vocab] array, a scatter into it and a pad of
    the logits' cotangent."""
    logits = logits_btv.astype(jnp.float32)
    targets = jnp.pad(tokens_bt[:, 1:], ((0, 0), (0, 1)))
    mask = jnp.pad(mask_bt[:, 1:], ((0, 0), (0, 1))).astype(jnp.float32)
    vocab = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2)
    target_logit = jnp.sum(jnp.where(vocab == targets[..., None], logits, 0.0), axis=-1)
    nll = jax.nn.logsumexp(logits, axis=-1) - target_logit
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def lora_value_and_grad(model):
    """(fn(lora_state, tokens, mask, dropout_key=None) -> (loss, grads), initial LoRA state).

    With a `dropout_key`, adapters with dropout draw their masks from it (training); without, none is applied.
    The frozen rest of the model is read from `model` at each call, so a device expert cache refreshed between
    steps is used at once; a change of structure (a resized cache) recompiles.
    """
    model.prepare_for_training()
    keep_step_buffers()  # each step's logits and attention weights reuse the last step's memory
    graphdef, lora_state, rest = split_trainable(model.transformer)
    parallel = model.expert_shard is not None
    compiled = {"graphdef": model.graphdef, "state": model.state, "step": _compile(graphdef, parallel), "rest": rest}

    def value_and_grad(lora_state, tokens_bt, mask_bt, dropout_key=None):
        if compiled["state"] is not model.state:  # split again only when the model changed
            graphdef, _, rest = split_trainable(model.transformer)
            if compiled["graphdef"] is not model.graphdef:
                compiled["step"] = _compile(graphdef, parallel)
            compiled.update(graphdef=model.graphdef, state=model.state, rest=rest)
        return compiled["step"](lora_state, compiled["rest"], tokens_bt, mask_bt, dropout_key)

    return value_and_grad, lora_state


def _compile(graphdef, expert_parallel: bool):
    def loss_fn(lora_state, rest, tokens_bt, mask_bt, dropout_key=None):
        positions = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
        with lora_dropout_key(dropout_key):
            logits, _ = nnx.merge(graphdef, lora_state, rest)(tokens_bt, positions)
        return causal_lm_loss(logits, tokens_bt, mask_bt)

    if not expert_parallel:
        return jax.jit(jax.value_and_grad(loss_fn))

    def one_process(lora_state, rest, tokens_bt, mask_bt, *dropout_key):
        """This process's rows, weighted by its share of all targets; summed over the processes."""
        mine = jnp.sum(mask_bt[:, 1:].astype(jnp.float32))
        share = mine / jnp.maximum(jax.lax.psum(mine, distributed.AXIS), 1.0)
        key = jax.random.fold_in(dropout_key[0], jax.lax.axis_index(distributed.AXIS)) if dropout_key else None

        def weighted(lora_state):
            return loss_fn(lora_state, rest, tokens_bt, mask_bt, key) * share

        return jax.lax.psum(jax.value_and_grad(weighted)(lora_state), distributed.AXIS)

    steps = {keyed: over_processes(one_process, (SAME, SAME, ROWS, ROWS) + (SAME,) * keyed, SAME) for keyed in (0, 1)}

    def step(lora_state, rest, tokens_bt, mask_bt, dropout_key=None):
        extra = () if dropout_key is None else (dropout_key,)
        return steps[len(extra)](lora_state, rest, tokens_bt, mask_bt, *extra)

    return step
