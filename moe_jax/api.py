"""The public API: `load_model(path, backend=...)` and the `Model` it returns.

Everything outside the package (the CLIs, tests, user scripts) goes through this file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import re
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from host_kernels import trim_heap
from moe_jax import distributed
from moe_jax.backends import BACKENDS, PLACEMENTS, ExpertPlacement, PlacementOptions, make_placement
from moe_jax.backends.expert_parallel import ROWS, SAME, over_processes
from moe_jax.backends.metrics import BackendMetrics
from moe_jax.compile_memory import trim_after_compiles
from moe_jax.distributed import ExpertShard
from moe_jax.errors import CheckpointError, InputError
from moe_jax.formats.adapters import MOE_JAX_CONFIG, PEFT_CONFIG, apply_adapter, projection_adapters, read_adapter
from moe_jax.formats.checkpoint import Checkpoint, open_checkpoint
from moe_jax.formats.gguf_checkpoint import GGUFFile
from moe_jax.formats.hub import resolve_model
from moe_jax.formats.tokenizer import Tokenizer, load_tokenizer
from moe_jax.generation.compiled import CompiledGeneration
from moe_jax.generation.generate import generate
from moe_jax.generation.kv_cache import KVCacheMemory
from moe_jax.model.config import ModelConfig
from moe_jax.model.lora import EXPERTS_TARGET, LoRAConfig, attach_lora, resolve_targets
from moe_jax.model.served_adapters import NO_ADAPTER, attach_served
from moe_jax.model.transformer import Transformer, build_transformer
from moe_jax.planning.cost_model import Profile
from moe_jax.planning.memory_check import check_fits, load_bytes, quantization_hint
from moe_jax.planning.memory_split import split_device_memory
from moe_jax.planning.model_shape import step_shape
from moe_jax.planning.pipeline_model import plan_with_profile
from moe_jax.planning.plan import ExecutionPlan, host_store_dtype, make_plan
from moe_jax.planning.probe import cached_profile

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
AUTO_DTYPE = "auto"  # the checkpoint's own (formats.checkpoint.Checkpoint.own_dtype)
DTYPE_CHOICES = (AUTO_DTYPE, *DTYPES)
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
DTYPE_HELP = "weights and activations: auto (default) keeps the checkpoint's own, bfloat16 for a bfloat16 one"


class Model:
    """A loaded MoE model with one expert placement (`backend`)."""

    def __init__(
        self,
        transformer: Transformer,
        tokenizer: Tokenizer | None,
        placement: ExpertPlacement,
        dtype: str,
        checkpoint: Checkpoint,
        plan: ExecutionPlan,
    ):
        self.config: ModelConfig = transformer.config
        self.plan = plan  # where each part runs (moe_jax/planning/plan.py), decided at load
        self.tokenizer = tokenizer
        self.placement = placement
        self.backend = placement.name
        self.dtype = dtype
        self.checkpoint = checkpoint
        self.expert_shard: ExpertShard | None = placement.expert_shard  # expert parallel: this process's experts
        self.lora_config: LoRAConfig | None = None
        self.served_adapters: tuple[str, ...] = ()  # chosen per request (serve_adapters); index i + 1 each
        self.adapter_sources: dict[str, str] = {}  # each served adapter's directory
        self._adapter_sets = 0  # serve_adapters calls: a set's anchor cache scopes are its own
        self.device_budget_bytes: int | None = None  # KV cache + expert weights, when a split is set
        self.kv = KVCacheMemory(self.config, DTYPES[dtype])
        self.generation = CompiledGeneration(self)
        self._leaves, self._leaves_of = [], None  # state_leaves() and the state they are of
        self._closed = False
        self._set_transformer(transformer)

    def _set_transformer(self, transformer: Transformer):
        self.graphdef, self.state = nnx.split(transformer)
        graphdef = self.graphdef

        def forward(state, tokens_bt, positions_bt):
            return nnx.merge(graphdef, state)(tokens_bt, positions_bt)[0]

        if self.expert_shard is None:
            self._forward_jit = jax.jit(forward)
        else:  # a step of every process, each with its rows (the experts' tokens travel between them)
            self._forward_jit = over_processes(forward, (SAME, ROWS, ROWS), ROWS)

    def close(self):
        """Lets go of the model's weights now, as dropping its last reference does (the model, its state, its
        compiled steps and its expert placement: the host store, the device cache), while something else still
        refers to the model. Using it after is an error; what was taken from it (its `transformer`) keeps what it
        holds. Also `with load_model(...) as model:`."""
        if self._closed:
            return
        self._closed = True
        self.graphdef = self.state = self._forward_jit = self.placement = self.checkpoint = None
        self._leaves, self._leaves_of = [], None
        self.generation = CompiledGeneration(self)  # none compiled
        gc.collect()  # the host engine's objects refer to each other: freed by the cycle collector, now
        trim_heap()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc):
        self.close()

    def _check_open(self):
        if self._closed:
            raise InputError("this model was closed (Model.close): load it again to use it")

    @property
    def quantized_experts(self) -> bool:
        return self.plan.host_kernels is not None and self.plan.host_kernels.quantized

    def attach_lora(self, config: LoRAConfig, seed: int = 0):
        """Adds fresh LoRA adapters (peft's initialisation) to the targeted modules (`attention` expanded to this
        family's projections; a target this model does not have is refused)."""
        config = dataclasses.replace(config, targets=resolve_targets(config.targets, self.config))
        self._check_shardable(config)
        transformer = self.transformer
        attach_lora(transformer, config, seed)
        self._set_transformer(transformer)
        self.lora_config = config

    def load_adapter(self, adapter_dir):
        """Attaches the adapter saved in `adapter_dir` (PEFT format, or a train.py run directory)."""
        config, tensors = read_adapter(resolve_adapter_dir(adapter_dir))
        self._check_shardable(config)
        transformer = self.transformer
        attach_lora(transformer, config)
        apply_adapter(transformer, tensors, adapter_dir)
        self._set_transformer(transformer)
        self.lora_config = config

    def serve_adapters(self, adapters: Mapping[str, str | Path]):
        """Holds these LoRA adapters ({name: PEFT directory or train run}) side by side for generation requests
        that each choose one by name (`generate(adapter=...)`, the server's --lora-modules); one batch mixes them
        (model/served_adapters.py). Replaces the set served before ({}: none); an adapter attached with
        `load_adapter` stays under all of them. Adapters on the attention and MLP projections only: routed
        experts' adapters cannot change from row to row of the host experts' call."""
        loaded, sources = [], {}
        for name, path in adapters.items():
            if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name):
                raise InputError(
                    f"adapter name {name!r}: use letters, digits and . _ - (at most 64, starting with a letter or "
                    "digit); a request names it as the model or as <model>:<name>"
                )
            directory = resolve_adapter_dir(path)
            if not directory.is_dir():
                raise CheckpointError(f"{path}: no such adapter directory (adapter {name!r})")
            config, tensors = read_adapter(directory)
            config = dataclasses.replace(config, targets=resolve_targets(config.targets, self.config))
            if EXPERTS_TARGET in config.targets:
                raise InputError(
                    f"adapter {name!r} ({path}) trains the routed experts: per-request adapters cover the "
                    "attention and MLP projections; load it as the model's own adapter (--adapter) instead"
                )
            loaded.append((projection_adapters(self.transformer, config, tensors, directory), config.scale))
            sources[name] = str(directory)
        self._edit(lambda transformer: attach_served(transformer, loaded))
        self.served_adapters, self.adapter_sources = tuple(adapters), sources
        self._adapter_sets += 1

    def adapter_index(self, name: str | None) -> int:
        """The index generation requests carry for a served adapter's name (0 for None: the model as loaded)."""
        if name is None:
            return NO_ADAPTER
        if name not in self.served_adapters:
            served = ", ".join(self.served_adapters) or "none (Model.serve_adapters, the server's --lora-modules)"
            raise InputError(f"no adapter named {name!r} is served; served: {served}")
        return self.served_adapters.index(name) + 1

    def adapter_scope(self, index: int) -> bytes:
        """What sets a served adapter's anchor cache entries apart (its KV is not the base model's, nor that of an
        adapter of the same name served before)."""
        return b"" if not index else f"\0adapter {self._adapter_sets}:{self.served_adapters[index - 1]}".encode()

    def _check_shardable(self, config: LoRAConfig):
        if self.expert_shard is not None and EXPERTS_TARGET in config.targets:
            raise InputError(
                f"LoRA on the routed experts with expert parallel ({self.expert_shard.describe()}) is not built yet: "
                "each process would hold its shard's adapters; target the attention or MLP projections"
            )

    def prepare_for_training(self):
        """Holds what the plan's training steps read besides the forward's weights: the fused backward's packed
        layers where the stream calls run it, copies of the frozen weights (bfloat16 on XLA:CPU: transposed
        weights for the backward, `ExecutionPlan.transposed_weights`); once."""
        self.placement.prepare(self.transformer, training=True)
        if self.plan.transposed_weights:
            self._edit(lambda transformer: transformer.keep_transposed_weights(self.plan.training_head))

    def set_lora_state(self, lora_state):
        """Replaces the LoRA parameters' values (same structure); compiled steps are reused."""
        self._edit(lambda transformer: nnx.update(transformer, lora_state))

    def _edit(self, change):
        """Applies `change(transformer)`; keeps compiled steps when only values changed, not structure."""
        transformer = self.transformer
        result = change(transformer)
        graphdef, state = nnx.split(transformer)
        if graphdef == self.graphdef:
            self.state = state
        else:
            self._set_transformer(transformer)
        return result

    # ------------------------------------------------------------------ device memory: KV cache vs experts
    def set_memory_split(self, *, kv_fraction: float | None = None, kv_bytes: int | None = None):
        """Shares `device_budget_bytes` (given at load) between the KV cache and the expert weights the backend
        keeps on the device (auto's cache and stream buffers, offload's rounds, a hybrid plan). Takes effect
        between generation batches or training steps; weights already on the host are not reloaded."""
        if self.device_budget_bytes is None:
            raise InputError("set_memory_split needs a device budget: load_model(..., device_budget_bytes=N)")
        if (kv_fraction is None) == (kv_bytes is None):
            raise InputError("give exactly one of kv_fraction and kv_bytes")
        split = split_device_memory(self.device_budget_bytes, kv_fraction, kv_bytes)
        if self.kv.live_bytes > split.kv:
            raise InputError(f"a running generation holds {self.kv.live_bytes} bytes of KV cache; finish it first")
        self._edit(lambda transformer: self.placement.set_expert_budget(split.experts, transformer))
        self.kv.budget_bytes = split.kv

    def memory_split(self) -> dict:
        """Device bytes: the budget, the KV cache's share and use, the expert side's share and use."""
        experts = self.placement.device_expert_bytes(self.transformer)
        return {
            "budget": self.device_budget_bytes,
            "kv_budget": self.kv.budget_bytes,
            "kv_in_use": self.kv.live_bytes,
            "experts_in_use": experts,
        }

    def refresh_expert_cache(self) -> bool:
        """auto: updates the device expert cache from the routing seen since the last call (bounded churn).
        The generation engine and the trainer call this between steps."""
        self._check_open()
        if not self.placement.cache_in_use:  # nothing to place, or every call shape runs on the host path
            return False
        return self._edit(self.placement.refresh_expert_cache)

    def calibrate_expert_cache(self, input_ids):
        """auto: fills the device expert cache from the routing of a calibration batch [batch, seq]."""
        self.logits(input_ids)
        cache = self.placement.expert_cache
        if cache is not None:
            max_swaps, cache.max_swaps = cache.max_swaps, cache.capacity  # no churn bound for a fresh fill
            try:
                self.refresh_expert_cache()
            finally:
                cache.max_swaps = max_swaps

    def state_leaves(self) -> list:
        """The state's arrays in flattening order (what the generation steps take), kept until it changes."""
        self._check_open()
        if self._leaves_of is not self.state:
            self._leaves, self._leaves_of = jax.tree.leaves(self.state), self.state
        return self._leaves

    def run_jitted(self, fn, *args):
        """Runs a jitted function of this model and waits for its results (see host_errors)."""
        with self.host_errors():
            return jax.block_until_ready(fn(*args))

    @contextlib.contextmanager
    def host_errors(self):
        """An error raised inside a host callback of this model's steps, surfacing in the block (when a result
        is waited for), is re-raised as itself: XLA would wrap it in a runtime error with the traceback
        flattened into the message."""
        try:
            yield
        except Exception:
            error = self.placement.take_error()
            if error is not None:
                raise error from None
            raise

    def metrics(self) -> BackendMetrics:
        """Backend figures (bytes moved, host busy, device wait, ...) since the previous call."""
        self._check_open()
        return self.placement.take_metrics()

    @property
    def transformer(self) -> Transformer:
        self._check_open()
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
        """float32 logits [batch, seq, vocab] for integer token ids [batch, seq] (expert parallel: this process's
        rows of the batch, in a call every process of the run makes with its own)."""
        self._check_open()
        ids = self.check_token_ids(input_ids)
        if ids.ndim != 2 or ids.shape[1] == 0:
            raise InputError(f"input_ids must have shape [batch, seq] with seq >= 1, got {ids.shape}")
        positions = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape)
        logits = self.run_jitted(self._forward_jit, self.state, ids, positions)
        return np.asarray(logits, dtype=np.float32)

    def pack_for_decode(self):
        """Where the plan multiplies a decode step's dense products natively, packs the dense weights for it
        (Transformer.pack_for_decode); once."""
        if self.plan.dense_decode and "head_packed" not in self.state:
            plan = self.plan
            self._edit(lambda transformer: transformer.pack_for_decode(plan.dense_decode, plan.router_kernel))
            trim_heap()  # the packing's temporaries

    def engine(self, slots: int, max_len: int, anchor_cache=None, drafts: int = 0):
        """A generation engine over this model for `slots` sequences of up to `max_len` tokens, speculative with
        up to `drafts` prompt-lookup drafts a step (see CompiledGeneration.engine)."""
        self._check_open()
        return self.generation.engine(slots, max_len, anchor_cache, drafts)

    # (prompts, *, max_new_tokens, temperature, top_p, seed, adapter, draft_tokens): generation/generate.py
    generate = generate


def load_model(
    path,
    *,
    backend: str = "host",
    dtype: str = AUTO_DTYPE,
    adapter=None,
    adapters: Mapping[str, str | Path] | None = None,
    host_threads: int | None = None,
    device_budget_bytes: int | None = None,
    kv_fraction: float | None = None,
    device_experts: dict[int, list[int]] | None = None,
    profile=None,
    calibrate: bool = True,
    verify: bool = False,
    native: bool | None = None,
    xla_ffi: bool | None = None,
    host_kernels=None,
    quant: str | None = None,
    mla_decode: str = "absorbed",
    expert_shard: ExpertShard | None = None,
    pipeline: int | None = None,
    host_call: str | None = None,
) -> Model:
    """Loads a Hugging Face checkpoint directory, a GGUF file, a converted directory (`moe-jax convert`), or a
    model by Hugging Face Hub id (`Qwen/Qwen3-30B-A3B`, `org/repo/file.gguf`: fetched into the Hub cache once,
    formats/hub.py).

    `dtype`: "auto" (default) keeps the checkpoint's own precision, as transformers' dtype="auto" does: bfloat16
    for a bfloat16 (or fp8, or quantized GGUF) checkpoint, float32 for a float32 or float16 one; or "float32" /
    "bfloat16" whatever it holds. `Model.dtype` says which was chosen.

    `adapter`: a LoRA adapter directory (PEFT format, or a train run) attached to the model; `adapters`: {name:
    directory} of adapters each generation request may choose (`Model.serve_adapters`).
    `host_threads` sets the host expert engine's worker threads (default: the cores available).
    `device_budget_bytes` is the device memory for expert weights (offload's rounds, auto's cache and streams);
    with `kv_fraction`, that share of it goes to the KV cache instead (see `Model.set_memory_split`).
    `device_experts` ({layer: [expert ids]}) names the experts the hybrid backend keeps on the device.
    `profile` (backend="auto"): a probe profile (path or cost_model.Profile); by default this machine's, measured
    once for the model's expert shape and kept under ~/.cache/moe_jax. `calibrate` (auto): time one real layer
    both ways at load where the profile predicts a device gain, and use the host path where it measures faster
    (a few seconds; off only for a profile known to be right, or to test the planner's device path).
    `verify`: check a converted directory's expert files against the SHA-256 checksums convert recorded.
    `native`: False runs everything in XLA and numpy (no native kernels or FFI handlers), True uses every native
    part this machine runs; None (default) the same, unless MOE_JAX_XLA_FFI=0 / MOE_JAX_HOST_KERNEL=numpy say
    otherwise. `xla_ffi` (default: as `native`) turns the XLA FFI handlers alone on or off; `host_kernels` (a
    `host_kernels.KernelChoice`) replaces the host kernel choice. `quant`: "int8" (a scale per output column),
    "int4" (a float16 scale per group of 32 k-rows, llama.cpp's Q4_0 rule; "int4-g64", "int4-g128": groups of 64,
    128), "mxfp4" (e2m1 values, a power of two per 32 k-rows: GPT-OSS's format, whose releases load so on the host
    backend by default, code for code; a quantized GGUF file's experts load by default in the closest of these,
    Q4_0 and MXFP4 value for value, `moe_jax.convert`'s rule): the host experts are quantized as they are loaded and
    kept only so (a store converted with `moe_jax.convert --quant` is already, and says its format itself); the
    fused forward reads them, the engine's GEMMs (expert LoRA, training's backward) dequantize them expert by
    expert, so LoRA trains on the quantized base. The model's generation steps then read their dense weights
    quantized too (float32 and bfloat16 models alike, as llama.cpp's Q8_0 / Q4_0 files hold them; not with mxfp4,
    which quantizes experts only), where they multiply them natively (a quantized copy beside the weights, which
    `logits` and training use). Only the host
    backend runs quantized experts. `mla_decode` (DeepSeek's latent attention): "absorbed" decode steps read the
    compressed KV cache as it is, "expanded" ones multiply it out to keys and values first (moe_jax/model/mla.py). The
    resulting plan is `Model.plan` (moe_jax/planning/plan.py). `expert_shard` (expert parallel, host backend, a
    multi-process run): this process holds and computes only that shard of every layer's experts; the model then
    runs its steps over all the run's processes (`Model.logits`, training's gradients), each with its own rows.
    `pipeline`: split each step's rows into that many micro-batches whose host experts and device attention
    ping-pong (backends/pipeline.py); default (None): MOE_JAX_PIPELINE, else beside an accelerator 2 for prefill
    and training steps and none for decode steps (for auto: what its probe profile predicts fastest), and off where
    jax's device is this CPU (`Model.plan` says why). `host_call`: how jitted steps reach the host experts, "ffi"
    (XLA:CPU's handler), "stream" (stream-ordered calls to a host worker: the default beside an accelerator) or
    "callback" (`jax.pure_callback`, to compare against); default MOE_JAX_HOST_CALL, else the plan's choice.
    """
    _check_arguments(backend, dtype, expert_shard, adapter)
    split = split_device_memory(device_budget_bytes, kv_fraction)
    distributed.join()  # a multi-process run, when the environment says so (a no-op otherwise, or once joined)
    trim_after_compiles()  # the steps this model compiles leave no heap behind
    checkpoint = open_checkpoint(resolve_model(path), verify=verify, expert_shard=expert_shard)
    dtype = checkpoint.own_dtype() if dtype == AUTO_DTYPE else dtype
    kind, jdtype = PLACEMENTS[backend], DTYPES[dtype]
    quant = _experts_format(checkpoint, backend, quant)
    if expert_shard is not None:  # its MoE layers' collectives run inside the call: no ping-pong
        if pipeline not in (None, 1):
            raise InputError("expert parallel runs without the micro-batch pipeline; leave pipeline unset")
        pipeline = 1
    plan = make_plan(
        dtype,
        host_store_dtype(checkpoint, dtype) if kind.host_engine else None,
        native,
        xla_ffi,
        host_kernels,
        quant,
        mla_decode if checkpoint.config.mla is not None else "",
        pipeline,
        host_call,
        attention_sinks=checkpoint.config.attention_sinks,
    )
    _check_memory(checkpoint, kind, jdtype, plan, expert_shard)
    if kind.needs_profile:
        profile = resolve_profile(profile, checkpoint.config, jdtype)
        if plan.micro_batches > 1 and not plan.pipeline_asked:
            plan = plan_with_profile(plan, profile, step_shape(checkpoint.config, np.dtype(jdtype).itemsize))
    expert_budget = split.experts if split else None
    options = PlacementOptions(host_threads, expert_budget, device_experts, profile, calibrate, expert_shard)
    model = _build(checkpoint, backend, jdtype, dtype, plan, options)
    if split is not None:
        model.device_budget_bytes, model.kv.budget_bytes = split.budget, split.kv
    if adapter is not None:
        model.load_adapter(adapter)
    if adapters:
        model.serve_adapters(adapters)
    return model


def _check_arguments(backend: str, dtype: str, expert_shard: ExpertShard | None, adapter):
    """load_model's arguments that can be refused before anything is read."""
    if backend not in BACKENDS:
        raise InputError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if dtype not in DTYPE_CHOICES:
        raise InputError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPE_CHOICES)}")
    if expert_shard is not None and backend != "host":
        raise InputError(f"expert parallel runs on the host backend only, not backend={backend!r}")
    if adapter is not None and not Path(adapter).is_dir():
        raise CheckpointError(f"{adapter}: no such adapter directory")


def _experts_format(checkpoint, backend: str, quant: str | None) -> str | None:
    """The host experts' quantized format: asked for, the store's own, or as the checkpoint ships them (GPT-OSS's
    MXFP4, on a backend that runs quantized experts); refused where the backend cannot run it."""
    kind = PLACEMENTS[backend]
    quant = stored_quant(checkpoint, quant)
    if quant is None and kind.quantized_experts:  # experts shipped quantized (GPT-OSS's MXFP4) stay as shipped
        quant = checkpoint.shipped_quant()
    if quant is not None and not kind.quantized_experts:
        raise InputError(
            f"{quant} experts run on the host backend only; backend={backend!r} "
            f"{'may compute some on the device' if kind.host_engine else 'runs none on the host'}"
        )
    return quant


def _check_memory(checkpoint, kind, jdtype, plan, expert_shard: ExpertShard | None):
    """Refuses a model that would not fit this machine's memory (this process's share of an expert-parallel run),
    before anything is built; and a shard count that leaves experts uncomputed."""
    shards = expert_shard.count if expert_shard else 1
    if expert_shard is not None and shards != distributed.world().count:
        raise InputError(
            f"{expert_shard.describe()}: a run of {distributed.world().count} process(es) would leave experts "
            "uncomputed; expert shards are one per process"
        )
    parts = load_bytes(checkpoint, np.dtype(jdtype).itemsize, plan.host_kernels, shards)
    hint = quantization_hint(checkpoint, parts) if kind.quantized_experts and not plan.quant else ""
    check_fits(parts, f"loading {checkpoint.path}", hint=hint)


def _build(checkpoint, backend: str, jdtype, dtype: str, plan, options: PlacementOptions) -> Model:
    """The placement of the experts, the transformer around them, and the model."""

    def dense(name, dtype=None):  # dtype: a weight the family keeps in float32 whatever the model's dtype
        return jnp.asarray(checkpoint.dense(name), dtype=dtype or jdtype)

    placement = make_placement(backend, checkpoint, jdtype, plan, options)
    transformer = build_transformer(checkpoint.config, dense, placement.experts_for_layer, checkpoint.has, plan)
    placement.prepare(transformer)
    # the weights read from the files are copies by now, or views JAX kept in place (a table already in the
    # model's dtype, such as the embedding): those read their pages back as they are used (only the rows used)
    checkpoint.tensors.release_pages()
    gguf_file = checkpoint.tensors if isinstance(checkpoint.tensors, GGUFFile) else None
    return Model(transformer, load_tokenizer(checkpoint.path, gguf_file), placement, dtype, checkpoint, plan)


def stored_quant(checkpoint, quant: str | None) -> str | None:
    """The experts' quantized format: a quantized store's own (`quant` may only repeat it), else `quant`."""
    store = checkpoint.expert_store
    if store is None or store.quant is None:
        return quant
    if quant not in (None, store.quant):
        raise InputError(f"{checkpoint.path} holds {store.quant} experts: quant={quant!r} cannot requantize them")
    return store.quant


def resolve_adapter_dir(path) -> Path:
    """A train.py run directory points at its exported adapter; a PEFT directory is itself."""
    path = Path(path)

    def is_adapter(d: Path) -> bool:
        return (d / PEFT_CONFIG).exists() or (d / MOE_JAX_CONFIG).exists()

    return path / "adapter" if not is_adapter(path) and is_adapter(path / "adapter") else path


def resolve_profile(profile, config, dtype):
    """A probe profile for backend="auto": given, loaded from a path, or measured here once and cached."""
    if profile is None:
        profile = cached_profile(config.hidden_size, config.expert_intermediate_size)
    elif not isinstance(profile, Profile):
        profile = Profile.load(profile)
    return profile.for_dtype(np.dtype(dtype).itemsize)
