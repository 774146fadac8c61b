"""The public API: `load_model(path, backend=...)` and the `Model` it returns.

Everything outside the package (the CLIs, tests, user scripts) goes through this file.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moe_jax.backends import BACKENDS, Backend
from moe_jax.backends.metrics import BackendMetrics
from moe_jax.checkpoint import Checkpoint, open_checkpoint
from moe_jax.config import ModelConfig
from moe_jax.errors import CheckpointError, InputError
from moe_jax.lora import LoRAConfig, attach_lora
from moe_jax.model import Transformer, build_transformer
from moe_jax.tokenizer import Tokenizer, load_tokenizer

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class Model:
    """A loaded MoE model with one expert placement (`backend`)."""

    def __init__(
        self,
        transformer: Transformer,
        tokenizer: Tokenizer | None,
        placement: Backend,
        dtype: str,
        checkpoint: Checkpoint,
    ):
        self.config: ModelConfig = transformer.config
        self.tokenizer = tokenizer
        self.placement = placement
        self.backend = placement.name
        self.dtype = dtype
        self.checkpoint = checkpoint
        self.lora_config: LoRAConfig | None = None
        self._set_transformer(transformer)

    def _set_transformer(self, transformer: Transformer):
        self.graphdef, self.state = nnx.split(transformer)
        self._engines = {}  # compiled for the old structure
        graphdef = self.graphdef

        def forward(state, tokens_bt, positions_bt):
            return nnx.merge(graphdef, state)(tokens_bt, positions_bt)[0]

        self._forward_jit = jax.jit(forward)

    def attach_lora(self, config: LoRAConfig, seed: int = 0):
        """Adds fresh LoRA adapters (peft's initialisation) to the targeted modules."""
        transformer = self.transformer
        attach_lora(transformer, config, seed)
        self._set_transformer(transformer)
        self.lora_config = config

    def load_adapter(self, adapter_dir):
        """Attaches the adapter saved in `adapter_dir` (PEFT format, or a train.py run directory)."""
        from moe_jax.adapters import apply_adapter, read_adapter

        config, tensors = read_adapter(resolve_adapter_dir(adapter_dir))
        transformer = self.transformer
        attach_lora(transformer, config)
        apply_adapter(transformer, tensors, adapter_dir)
        self._set_transformer(transformer)
        self.lora_config = config

    def set_lora_state(self, lora_state):
        """Replaces the LoRA parameters' values (same structure); compiled steps are reused."""
        transformer = self.transformer
        nnx.update(transformer, lora_state)
        _, self.state = nnx.split(transformer)

    def run_jitted(self, fn, *args):
        """Runs a jitted function of this model; an error raised inside a host callback is re-raised here as
        itself (XLA would wrap it in a runtime error with the traceback flattened into the message)."""
        try:
            return jax.block_until_ready(fn(*args))
        except Exception:
            error = self.placement.take_error()
            if error is not None:
                raise error from None
            raise

    def metrics(self) -> BackendMetrics:
        """Backend figures (bytes moved, host busy, device wait, ...) since the previous call."""
        return self.placement.take_metrics()

    @property
    def transformer(self) -> Transformer:
        return nnx.merge(self.graphdef, self.state)

    def check_token_ids(self, input_ids) -> np.ndarray:
        ids = np.asarray(input_ids)
        if ids.dtype.kind not in "iu":
            raise InputError(f"token ids must be integers, got dtype {ids.dtype}")
        bad = np.argwhere((ids < 0) | (ids >= self.config.vocab_size))
        if bad.size:
            where = tuple(int(i) for i in bad[0])
            raise InputError(
                f"token id {int(ids[where])} at position {where} is outside the vocabulary "
                f"[0, {self.config.vocab_size})"
            )
        return ids.astype(np.int32)

    def logits(self, input_ids) -> np.ndarray:
        """float32 logits [batch, seq, vocab] for integer token ids [batch, seq]."""
        ids = self.check_token_ids(input_ids)
        if ids.ndim != 2 or ids.shape[1] == 0:
            raise InputError(f"input_ids must have shape [batch, seq] with seq >= 1, got {ids.shape}")
        positions = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape)
        logits = self.run_jitted(self._forward_jit, self.state, ids, positions)
        return np.asarray(logits, dtype=np.float32)

    def new_caches(self, batch: int, length: int):
        c = self.config
        shape = (batch, length, c.num_kv_heads, c.head_dim)
        dtype = DTYPES[self.dtype]
        return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(c.num_layers)]

    def engine(self, slots: int, max_len: int, anchor_cache=None):
        """A generation engine over this model; engines without an anchor cache are kept and reused, so their
        compiled steps are too (an evaluation loop does not recompile each time)."""
        from moe_jax.engine import TOKEN_BUCKET, GenerationEngine, round_up

        if anchor_cache is not None:
            return GenerationEngine(self, slots, max_len, anchor_cache)
        key = (slots, round_up(max_len, TOKEN_BUCKET))
        if key not in self._engines:
            self._engines[key] = GenerationEngine(self, *key)
        engine = self._engines[key]
        engine.stats = type(engine.stats)()
        return engine

    def generate(
        self, prompts, *, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0
    ) -> list:
        """Generates for a batch of prompts: token-id lists give token-id lists, strings give strings."""
        from moe_jax.generate import generate

        return generate(self, prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)


def load_model(
    path,
    *,
    backend: str = "host",
    dtype: str = "float32",
    adapter=None,
    host_threads: int | None = None,
    device_budget_bytes: int | None = None,
    placement_plan: dict[int, list[int]] | None = None,
) -> Model:
    """Loads a Hugging Face checkpoint directory or a converted one (`python -m moe_jax.convert`).

    `host_threads` sets the host expert engine's worker threads (default: the cores available).
    `device_budget_bytes` caps the expert bytes the offload backend keeps on the device at once.
    `placement_plan` ({layer: [expert ids]}) names the experts the hybrid backend keeps on the device.
    """
    if backend not in BACKENDS:
        raise InputError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if dtype not in DTYPES:
        raise InputError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if adapter is not None and not Path(adapter).is_dir():
        raise CheckpointError(f"{adapter}: no such adapter directory")
    checkpoint = open_checkpoint(Path(path))
    jdtype = DTYPES[dtype]

    def dense(name):
        return jnp.asarray(checkpoint.dense(name), dtype=jdtype)

    placement = Backend(
        backend,
        checkpoint,
        jdtype,
        host_threads=host_threads,
        device_budget_bytes=device_budget_bytes,
        placement_plan=placement_plan,
    )
    transformer = build_transformer(checkpoint.config, dense, placement.experts_for_layer, checkpoint.has)
    model = Model(transformer, load_tokenizer(checkpoint.path), placement, dtype, checkpoint)
    if adapter is not None:
        model.load_adapter(adapter)
    return model


def resolve_adapter_dir(path) -> Path:
    """A train.py run directory points at its exported adapter; a PEFT directory is itself."""
    path = Path(path)
    if not (path / "adapter_config.json").exists() and (path / "adapter" / "adapter_config.json").exists():
        return path / "adapter"
    return path
