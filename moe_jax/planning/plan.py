"""The execution plan: where every part of a model's steps runs, decided once, at load.

How it works and why: docs/INTERNALS.md, moe_jax/planning/plan.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np

from host_kernels import KernelChoice, choose_kernels
from host_kernels.stream_worker import cuda_memops
from moe_jax.errors import InputError
from moe_jax.native import argmax as native_argmax
from moe_jax.native import cache_attention as native_attention
from moe_jax.native import dense as native_dense
from moe_jax.native import ffi as native_ffi
from moe_jax.native import stream_experts
from moe_jax.planning import environment

BFLOAT16 = "bfloat16"
# how a jitted step reaches the host experts' fused forward: XLA:CPU's direct FFI handler, the stream-ordered
# submit/sync calls (an accelerator's stream), or a Python callback
FFI, STREAM, CALLBACK = "ffi", "stream", "callback"
HOST_CALLS = (FFI, STREAM, CALLBACK)
HOST_CALL_NAMES = {FFI: "through XLA FFI", STREAM: "by stream-ordered FFI calls", CALLBACK: "by pure_callback"}
ASKED = "asked by the caller"  # the reason of a choice the caller made
HOST_CALL_SHORT = {FFI: "FFI", STREAM: "stream calls", CALLBACK: "callback"}  # the one-line summary's


@dataclass(frozen=True)
class ExecutionPlan:
    platform: str  # where jax runs the jitted steps: "cpu", "gpu", ...
    dtype: str  # the model's: "float32" or "bfloat16"
    host_kernels: KernelChoice | None  # None: the placement runs no host engine
    host_call: str  # how a jitted step reaches the fused host forward: FFI, STREAM or CALLBACK
    cache_attention: bool  # native attention of new tokens over the KV cache (bfloat16 or float32)
    # the native kernel of bfloat16 decode steps' dense products ("amx-bf16", "avx512-int8", ...; "": XLA)
    dense_decode: str
    argmax: bool  # native token choice (greedy argmax, sampling) of float32 logits in decode steps
    transposed_weights: bool  # bfloat16 training on XLA:CPU keeps transposed copies of the frozen weights
    # bfloat16 on XLA:CPU: a one-row product gets a zero second row (XLA:CPU widens the weight for one row)
    pad_one_row: bool = False
    # with dense_decode: the routers' native kernels by their dtype ("float32", "bfloat16"), never quantized, so
    # the routing stays the model's
    router_decode: tuple[tuple[str, str], ...] = ()
    # the native kernel of bfloat16 training's head products (forward and input gradient; "": XLA's, on a
    # transposed copy): AVX512-BF16, where XLA:CPU's bfloat16 GEMMs are slower; elsewhere XLA's own
    training_head: str = ""
    # multi-head latent attention's decode steps: "absorbed" (over the compressed cache), "expanded"; "": not MLA
    mla_decode: str = ""
    # rows split into this many micro-batches whose host experts and device attention ping-pong (1: no pipeline;
    # model/transformer.Transformer.pipelined); why in `reason("pipeline")`
    micro_batches: int = 1
    decode_micro_batches: int = 1  # the same for decode steps (one token a row)
    pipeline_asked: bool = False  # the micro-batches were asked for (the caller, MOE_JAX_PIPELINE), not defaults
    # the stream calls' signal on CUDA (stream_experts.SIGNALS); "" where the host call is not STREAM
    stream_signal: str = ""
    why: tuple[tuple[str, str], ...] = ()  # (part, why it is not native) for each part that is not

    def router_kernel(self, dtype) -> str:
        """The native kernel of a router of `dtype` in decode steps, or "" (XLA)."""
        return dict(self.router_decode).get(np.dtype(dtype).name, "")

    def reason(self, part: str) -> str:
        return dict(self.why).get(part, "")

    @property
    def experts_ffi(self) -> bool:
        """XLA:CPU's FFI handler calls the fused host forward directly."""
        return self.host_call == FFI

    @property
    def quant(self) -> str | None:
        """The host experts' quantized format, or None."""
        return self.host_kernels.quant if self.host_kernels is not None else None

    def lines(self) -> list[str]:
        """What runs each part, one line each, with the reason where a part is not native."""

        def line(name, runs, part):
            why = self.reason(part)
            return f"{name}: {runs}" + (f" ({why})" if why else "")

        out = [f"platform: {self.platform}, dtype: {self.dtype}"]
        if self.host_kernels is not None:
            out += [f"host {part}" for part in self.host_kernels.describe()]
            called = HOST_CALL_NAMES[self.host_call]
            if self.stream_signal:
                called += f", signalled by {self.stream_signal}"
            out.append(line("host experts called", called, "host call"))
        out.append(line("cache attention", "native" if self.cache_attention else "XLA", "attention"))
        if self.mla_decode:
            out.append(f"latent attention decode: {self.mla_decode} form")
        out.append(
            line("decode dense products", f"native ({self.dense_decode})" if self.dense_decode else "XLA", "dense")
        )
        out.append(line("greedy argmax and sampling", "native" if self.argmax else "XLA", "argmax"))
        if self.host_kernels is not None:
            runs = f"{self.micro_batches} micro-batches" if self.micro_batches > 1 else "off"
            if self.decode_micro_batches != self.micro_batches:
                runs += f", decode steps {self.decode_micro_batches if self.decode_micro_batches > 1 else 'off'}"
            out.append(line("device/host micro-batch pipeline", runs, "pipeline"))
        if self.host_kernels is not None and self.host_kernels.quantized:
            out.append("training: LoRA on the quantized experts' base (the backward dequantizes each expert)")
        if self.transposed_weights:
            out.append("training: transposed copies of the frozen weights (bfloat16 backward on XLA:CPU)")
            out.append(
                line(
                    "training head products",
                    f"native ({self.training_head})" if self.training_head else "XLA",
                    "training head",
                )
            )
        return out

    def summary(self) -> str:
        """The plan in one line, for the CLIs' summaries."""
        parts = []
        if self.host_kernels is not None:
            fused = self.host_kernels.fused or f"engine {self.host_kernels.gemm}"
            parts.append(f"experts {fused} via {HOST_CALL_SHORT[self.host_call]}")
        parts.append(f"attention {'native' if self.cache_attention else 'XLA'}")
        parts.append(f"dense {'native' if self.dense_decode else 'XLA'}")
        parts.append(f"argmax {'native' if self.argmax else 'XLA'}")
        if self.micro_batches > 1:
            parts.append(f"pipeline {self.micro_batches} micro-batches")
        parts.append(f"{self.dtype} weights and activations")  # (dtype "auto" resolved: the checkpoint's own)
        return ", ".join(parts)


def host_store_dtype(checkpoint, dtype: str) -> np.dtype:
    """The dtype the host engine's experts are stored in (a quantized store's: the dtype its products take rows in):
    a converted store's own, else the model's bfloat16 or float32 (Hugging Face experts are stacked once in host
    RAM in it; backends.placements.HostPlacement._host_store)."""
    if checkpoint.expert_store is not None:
        return checkpoint.expert_store.dtype
    return model_dtype(dtype)


def model_dtype(dtype: str) -> np.dtype:
    return np.dtype(jax.numpy.bfloat16) if dtype == BFLOAT16 else np.dtype(np.float32)


def make_plan(
    dtype: str,
    store_dtype=None,
    native: bool | None = None,
    xla_ffi: bool | None = None,
    host_kernels: KernelChoice | None = None,
    quant: str | None = None,
    mla_decode: str = "",
    pipeline: int | None = None,
    host_call: str | None = None,
    attention_sinks: bool = False,
) -> ExecutionPlan:
    """The plan for a model of `dtype` whose host experts (if any: `store_dtype` None means none) are stored in
    `store_dtype`. `native`: True/False turns every native part on (where it runs) or off; `xla_ffi` (default:
    as `native`) the XLA FFI handlers alone (the host kernels then run through callbacks). None takes the
    environment's defaults: on, unless MOE_JAX_XLA_FFI=0 / MOE_JAX_HOST_KERNEL=numpy. `host_kernels` replaces
    the host kernel choice (`host_kernels.choose_kernels`), e.g. to run one kernel path against another; `quant`
    ("int8", "int4", ...: host_kernels.fused_forward.QUANTIZED) has the host experts' fused forward read them
    quantized. `mla_decode` (models with multi-head latent attention): "absorbed" or "expanded"
    (moe_jax/model/mla.py); their generation attention is XLA's (the native handler computes grouped-query attention).
    `pipeline`: micro-batches of the device/host ping-pong (`pipeline_choice`). `host_call` (FFI, STREAM or
    CALLBACK; default: MOE_JAX_HOST_CALL, else `host_call_choice`'s): how a jitted step reaches the host experts.
    `attention_sinks` (GPT-OSS): the model's softmax has a sink logit per head, which the native cache attention
    does not take."""
    if mla_decode not in ("", "absorbed", "expanded"):
        raise ValueError(f"mla_decode must be 'absorbed' or 'expanded', got {mla_decode!r}")
    why = {}
    xla_ffi = native if xla_ffi is None else xla_ffi
    turned_off = ""
    if xla_ffi is False:
        turned_off = "XLA FFI handlers turned off by the caller"
    elif xla_ffi is None:
        turned_off = environment.xla_ffi_off()
    ffi_on, ffi_off = (False, turned_off) if turned_off else native_ffi.status()

    def native_part(part: str, applies: bool, not_applicable: str, status) -> bool:
        """Whether `part` runs natively; its reason recorded where not."""
        if not applies:
            why[part] = not_applicable
            return False
        usable, reason = (ffi_on, ffi_off) if not ffi_on else status()
        if not usable:
            why[part] = reason
        return usable

    host = host_kernels
    if host is None and store_dtype is not None:
        env_off = environment.host_kernels_off() if native is None else ""
        host = choose_kernels(store_dtype, native is not False and not env_off, quant, env_off)
    call, signal = CALLBACK, ""
    if host is not None:
        call, why["host call"] = host_call_choice(host_call, bool(host.fused), turned_off)
        signal = stream_signal_choice() if call == STREAM else ""
    bf16 = dtype == BFLOAT16
    # with quant, the decode steps' dense weights are quantized like the experts (half the bytes a step reads)
    dense, dense_why = native_dense.dense_kernel(model_dtype(dtype), quant)
    training_head, training_why = training_head_kernel()
    dense_decode = dense if native_part("dense", True, "", lambda: (bool(dense), dense_why)) else ""
    routers = ((name, native_dense.dense_kernel(model_dtype(name))[0]) for name in ("float32", BFLOAT16))
    router_decode = tuple((name, kernel) for name, kernel in routers if kernel) if dense_decode else ()
    on_cpu = jax.default_backend() == "cpu"
    micro_batches, decode_micro_batches, why["pipeline"] = pipeline_choice(pipeline, host is not None)
    return ExecutionPlan(
        platform=jax.default_backend(),
        dtype=dtype,
        host_kernels=host,
        host_call=call,
        stream_signal=signal,
        cache_attention=native_part(
            "attention",
            not mla_decode and not attention_sinks,
            "latent attention (the native handler computes grouped-query attention)"
            if mla_decode
            else "attention sinks (the native handler has none)",
            native_attention.status,
        ),
        dense_decode=dense_decode,
        router_decode=router_decode,
        argmax=native_part("argmax", True, "", native_argmax.status),
        transposed_weights=bf16 and on_cpu,
        pad_one_row=bf16 and on_cpu,
        training_head=training_head
        if native_part("training head", bf16 and on_cpu, "not bfloat16 on XLA:CPU", training_why)
        else "",
        mla_decode=mla_decode,
        micro_batches=micro_batches,
        decode_micro_batches=decode_micro_batches,
        pipeline_asked=why["pipeline"] in (ASKED, environment.PIPELINE),
        why=tuple(why.items()),
    )


def host_call_choice(asked: str | None, fused: bool, turned_off: str = "") -> tuple[str, str]:
    """(how a jitted step reaches the host experts, why not another way). Asked for (the caller, else
    MOE_JAX_HOST_CALL), or by default: on XLA:CPU its FFI handler, which calls the fused forward on the step's own
    buffers and threads; beside an accelerator the stream-ordered calls, whose device side only enqueues copies and
    signals (a pure_callback there copies through unpinned buffers, synchronises the stream and takes the GIL);
    a callback where neither can run (no fused forward, FFI turned off, handlers not built). An unusable choice
    that was asked for is an error."""
    source = ASKED
    if asked is None and environment.host_call():
        asked, source = environment.host_call(), environment.HOST_CALL
    if asked is not None and asked not in HOST_CALLS:
        raise InputError(f"host call must be one of {', '.join(HOST_CALLS)}, got {asked!r} ({source})")
    if asked == CALLBACK:
        return CALLBACK, source
    unusable = "no fused forward to call" if not fused else turned_off
    on_cpu, by_default = jax.default_backend() == "cpu", asked is None
    if by_default:
        if unusable:
            return CALLBACK, unusable
        asked = FFI if on_cpu else STREAM
    usable, reason = native_ffi.status() if asked == FFI else stream_experts.status()
    if by_default:
        if not usable:
            return CALLBACK, reason
        return asked, "on XLA:CPU the handler calls the fused forward directly" if on_cpu else ""
    if unusable or not usable:
        raise InputError(f"host call {asked!r} ({source}) unavailable: {unusable or reason}")
    return asked, source


def stream_signal_choice() -> str:
    """How the stream calls' device side signals the host worker: MOE_JAX_STREAM_SIGNAL, else stream memory
    operations on the mapped flags where the GPU runs them (FreeToken measured CUDA's host functions at ~30-50 us a
    call and moved off them; bench/accelerator.sh measures both here), else host functions."""
    asked = environment.stream_signal()
    if asked is not None:
        if asked not in stream_experts.SIGNALS:
            signals = ", ".join(stream_experts.SIGNALS)
            raise InputError(f"{environment.STREAM_SIGNAL} must be one of {signals}, got {asked!r}")
        return asked
    if stream_experts.platform_name() != "cuda":
        return "host-functions"  # XLA:CPU's device side is host code either way
    return "memops" if cuda_memops() else "host-functions"


def training_head_kernel() -> tuple[str, Callable[[], tuple[bool, str]]]:
    """(the bfloat16 dense kernel for a training step's head, its status()): AVX512-BF16, whose head products
    outran XLA:CPU's bfloat16 GEMMs ~1.2x on AMD Zen 5; elsewhere XLA's own (AMX: oneDNN's tiles; AVX2: not
    measured against)."""
    kernel, why = native_dense.dense_kernel(model_dtype(BFLOAT16))
    if kernel and kernel != "avx512-bf16":
        return "", lambda: (False, f"{kernel}: XLA's own bfloat16 GEMMs (the native head is measured on AVX512-BF16)")
    return kernel, lambda: (bool(kernel), why)


def pipeline_choice(asked: int | None, host_lane: bool) -> tuple[int, int, str]:
    """(micro-batches of prefill and training steps, of decode steps, why): of a host lane's pipeline
    (model/transformer.Transformer.pipelined). Asked for (the caller, else MOE_JAX_PIPELINE: both kinds of step),
    or by default 2 beside an accelerator for steps of several tokens a row, and off where jax's device is this CPU:
    there the device lane's attention and the host lane's experts run on the same cores, so splitting the batch
    only adds callbacks (planning/pipeline_model.py predicts no gain there). Decode steps are not split by default:
    their device share is small and each micro-batch costs two callbacks a layer where the plain step makes one
    call (bench/pipeline.py: 0.73x generation speed with this CPU as two lanes)."""
    if not host_lane:
        return 1, 1, "no host lane"
    if asked is None and environment.pipeline() is not None:
        asked, source = environment.pipeline(), environment.PIPELINE
    else:
        source = ASKED
    if asked is not None:
        if asked < 1:
            raise InputError(f"pipeline micro-batches must be at least 1, got {asked}")
        return asked, asked, source
    if jax.default_backend() == "cpu":
        return 1, 1, "jax's device is this CPU: attention and the host experts would share its cores"
    return 2, 1, f"the {jax.default_backend()} computes attention while the host computes experts (decode steps plain)"
