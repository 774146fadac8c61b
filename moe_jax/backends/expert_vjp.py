"""The one differentiation rule every expert placement shares.

An expert function takes `(static, x_td, ids_tk, weights_tk, lora, *weights)` and returns y_td: `static` is the
placement's hashable settings (not differentiated), `lora` the expert LoRA arrays, `weights` any expert weights
passed as arrays (offload's host buffers, the hybrid cache). Gradients flow to x, the routing weights and the LoRA
arrays; the expert ids are integers (a float0 cotangent) and the expert weights are frozen (None).
"""

from __future__ import annotations

import functools

import jax
import numpy as np


def expert_function(forward, backward, forward_keeping=None):
    """A `jax.custom_vjp` expert function from its parts:
    forward(static, x, ids, weights, lora, *expert_weights) -> y;
    forward_keeping(same arguments) -> (y, kept): the forward under differentiation, `kept` any extra residual
    (default: `forward`, keeping nothing);
    backward(static, arguments, kept, dy) -> (dx, dweights, dlora), `arguments` the forward's own."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def experts(static, x_td, ids_tk, weights_tk, lora, *expert_weights):
        return forward(static, x_td, ids_tk, weights_tk, lora, *expert_weights)

    def forward_rule(static, *arguments):
        if forward_keeping is None:
            return forward(static, *arguments), (arguments, None)
        y, kept = forward_keeping(static, *arguments)
        return y, (arguments, kept)

    def backward_rule(static, residuals, dy_td):
        arguments, kept = residuals
        dx, dweights, dlora = backward(static, arguments, kept, dy_td)
        ids_cotangent = np.zeros(arguments[1].shape, dtype=jax.dtypes.float0)
        return (dx, ids_cotangent, dweights, dlora, *(None,) * (len(arguments) - 4))

    experts.defvjp(forward_rule, backward_rule)
    return experts


def gradient_shapes(x_td, weights_tk, lora: dict):
    """The shapes (dx, dweights, dlora) a host callback's backward returns."""
    return (
        jax.ShapeDtypeStruct(x_td.shape, x_td.dtype),
        jax.ShapeDtypeStruct(weights_tk.shape, weights_tk.dtype),
        {name: jax.ShapeDtypeStruct(a.shape, a.dtype) for name, a in lora.items()},
    )
