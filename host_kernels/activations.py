"""The SwiGLU elementwise passes of the engine: native (one pass, AVX-512 in host_kernels/csrc/swiglu.c or AVX2 in
csrc/avx2_swiglu.c) or numpy (in place, at most two tile-sized temporaries), as the caller chose
(host_kernels/choice.py). All compute in float32."""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from host_kernels import native
from host_kernels.errors import KernelArgumentError

NATIVE_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl")
CPU_FLAGS = {native.AVX512: NATIVE_CPU_FLAGS, native.AVX2: native.AVX2_CPU_FLAGS}  # each variant's, fastest first


@dataclass(frozen=True)
class GLU:
    """The gated activation a(g, u) between an expert's gate/up and down projections.

    "swiglu": silu(g) * u. "clamped_swiglu" (GPT-OSS): (clip(u, -limit, limit) + 1) * g' * sigmoid(alpha * g'),
    g' = min(g, limit)."""

    kind: str = "swiglu"
    alpha: float = 1.0
    limit: float = 0.0

    def __post_init__(self):
        if self.kind not in GLU_KINDS:
            raise KernelArgumentError(f"unknown expert activation {self.kind!r}; known: {', '.join(GLU_KINDS)}")
        if self.kind == "clamped_swiglu" and not (self.alpha > 0 and self.limit > 0):
            raise KernelArgumentError(f"a clamped SwiGLU needs alpha > 0 and limit > 0, got {self.alpha}, {self.limit}")

    @property
    def code(self) -> int:
        """The native passes' number for this kind (csrc/moe_call.h's MOE_GLU_*)."""
        return GLU_KINDS.index(self.kind)


GLU_KINDS = ("swiglu", "clamped_swiglu")
SWIGLU = GLU()


def status(isa: str = native.AVX512) -> tuple[bool, str]:
    """(usable, why not) for the native passes' `isa` variant on this machine."""
    return native.status(CPU_FLAGS[isa])


def best_isa() -> tuple[str | None, str]:
    """(the fastest variant of the native passes this machine runs, "") or (None, why none runs)."""
    return native.best_isa(native.variant_statuses(CPU_FLAGS))


def _native_pass(name: str, isa: str):
    """The library function of pass `name` in variant `isa`, refused where this machine cannot run it."""
    native.pick_isa({isa: status(isa)}, isa, "native SwiGLU pass")
    return getattr(native.lib(), native.symbol(name, isa))


def sigmoid(x, out=None):
    """0.5 * (1 + tanh(x / 2)): no overflow for large |x|, unlike 1 / (1 + exp(-x)); into `out`, or one temporary."""
    out = np.multiply(x, 0.5, out=out)
    np.tanh(out, out=out)
    out += 1.0
    out *= 0.5
    return out


def _check_arrays(shape, inputs: dict, outputs: dict):
    """Every array passed to a native SwiGLU pass: 2-D of `shape` with contiguous rows; inputs float32, outputs
    float32 or bfloat16 bits (uint16) and writable."""
    for name, array in {**inputs, **outputs}.items():
        if array.shape != shape:
            raise KernelArgumentError(f"{name} has shape {array.shape}, the pass works on {shape}")
        native.row_stride(array)
    for name, array in inputs.items():
        if array.dtype != np.float32:
            raise KernelArgumentError(f"{name} must be float32, got {array.dtype}")
    for name, array in outputs.items():
        if array.dtype not in (np.float32, np.uint16):
            raise KernelArgumentError(f"{name} must be float32 or uint16 (bfloat16 bits), got {array.dtype}")
        native.check_writable(name, array)


def swiglu_forward(hg, hu, act, *, isa: str | None, glu: GLU = SWIGLU):
    """act = glu(hg, hu) (silu(hg) * hu by default), into `act`: float32, or uint16 holding bfloat16 (a
    `amx.row_buffer`); a view with contiguous rows. `isa`: the native pass's variant (native.AVX512, native.AVX2;
    where `status(isa)` allows it), or None for numpy."""
    _check_arrays(hg.shape, inputs={"hg": hg, "hu": hu}, outputs={"act": act})
    if isa is not None:
        clamped = glu.kind == "clamped_swiglu"
        _native_pass("clamped_swiglu_forward" if clamped else "swiglu_forward", isa)(
            hg.ctypes.data, native.row_stride(hg), hu.ctypes.data, native.row_stride(hu), act.ctypes.data,
            native.row_stride(act), act.dtype == np.uint16, act.shape[0], act.shape[1],
            *((glu.alpha, glu.limit) if clamped else ()),
        )  # fmt: skip
        return
    if glu.kind == "clamped_swiglu":
        g = np.minimum(hg, glu.limit)
        out = np.multiply(g, glu.alpha, out=_float32_target(act))
        sigmoid(out, out=out)
        out *= g
        out *= np.clip(hu, -glu.limit, glu.limit) + 1
        _store(act, out)
        return
    out = sigmoid(hg, out=_float32_target(act))
    out *= hg
    out *= hu
    _store(act, out)


def swiglu_backward(hg, hu, grad, weight, dh_gate, dh_up, dw, act=None, *, isa: str | None, glu: GLU = SWIGLU):
    """Given grad = dL/da for a = glu(hg, hu) (silu(hg) * hu by default) before the rows' routing weights `weight`:
    writes dh_gate = w grad da/dhg, dh_up = w grad da/dhu (float32, or bfloat16 in uint16 views), dw[i] =
    <grad_i, a_i> (a column view), and `act` = a when given. May overwrite hg and grad (the numpy path works in
    place)."""
    outputs = {"dh_gate": dh_gate, "dh_up": dh_up} | ({} if act is None else {"act": act})
    _check_arrays(grad.shape, inputs={"hg": hg, "hu": hu, "grad": grad}, outputs=outputs)
    weight = np.ascontiguousarray(weight, np.float32)  # named: it must outlive the native call
    if weight.shape != (grad.shape[0],) or dw.shape != (grad.shape[0],) or dw.dtype != np.float32:
        raise KernelArgumentError(
            f"weight {weight.shape} and dw {dw.dtype} {dw.shape} must be float32 [{grad.shape[0]}]"
        )
    native.check_writable("dw", dw)
    if dh_up.strides != dh_gate.strides or dh_up.dtype != dh_gate.dtype:
        raise KernelArgumentError("dh_gate and dh_up must share dtype and strides")
    clamped = glu.kind == "clamped_swiglu"
    if isa is not None:
        _native_pass("clamped_swiglu_backward" if clamped else "swiglu_backward", isa)(
            hg.ctypes.data, native.row_stride(hg), hu.ctypes.data, native.row_stride(hu), grad.ctypes.data,
            native.row_stride(grad), weight.ctypes.data, dh_gate.ctypes.data,
            dh_up.ctypes.data, native.row_stride(dh_gate), dh_gate.dtype == np.uint16, dw.ctypes.data,
            dw.strides[0] // 4, native.address(act), 0 if act is None else native.row_stride(act), grad.shape[0],
            grad.shape[1], *((glu.alpha, glu.limit) if clamped else ()),
        )  # fmt: skip
        return
    if clamped:
        _clamped_backward_numpy(hg, hu, grad, weight, dh_gate, dh_up, dw, act, glu)
        return
    # in place, to keep tile-sized temporaries to two: sg, then silu'(hg); hg becomes silu(hg)
    sg = sigmoid(hg)
    dsilu = np.subtract(1.0, sg)
    dsilu *= hg
    dsilu += 1.0
    dsilu *= sg
    hg *= sg
    a = act if act is not None else sg
    np.multiply(hg, hu, out=a)
    dw[:] = np.einsum("pf,pf->p", grad, a)
    grad *= weight[:, None]
    gate, up = (_float32_target(out) for out in (dh_gate, dh_up))
    np.multiply(grad, hu, out=gate)
    gate *= dsilu
    np.multiply(grad, hg, out=up)
    _store(dh_gate, gate)
    _store(dh_up, up)


def _clamped_backward_numpy(hg, hu, grad, weight, dh_gate, dh_up, dw, act, glu: GLU):
    """swiglu_backward of the clamped SwiGLU: the clamps pass no gradient where they bind."""
    g = np.minimum(hg, glu.limit)
    up1 = np.clip(hu, -glu.limit, glu.limit) + 1
    s = sigmoid(g * glu.alpha)
    a_glu = g * s
    a = np.multiply(up1, a_glu, out=act)
    dw[:] = np.einsum("pf,pf->p", grad, a)
    grad *= weight[:, None]
    dglu = s * (1 + glu.alpha * g * (1 - s))
    _store(dh_gate, np.where(hg <= glu.limit, grad * up1 * dglu, 0).astype(np.float32))
    _store(dh_up, np.where(np.abs(hu) <= glu.limit, grad * a_glu, 0).astype(np.float32))


def _float32_target(out):
    """`out` itself when float32, else a float32 temporary that `_store` rounds into it."""
    return out if out.dtype == np.float32 else np.empty(out.shape, np.float32)


def _store(out, values):
    """out[...] = values, rounding to bfloat16 when `out` holds bfloat16 bits (uint16)."""
    if out.dtype == np.uint16:
        out[...] = values.astype(ml_dtypes.bfloat16).view(np.uint16)
    elif out is not values:
        out[...] = values
