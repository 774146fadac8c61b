"""Every Python wrapper of native code refuses bad arguments with a KernelArgumentError; none may crash the process
(issue 15, item 11). Each case runs in its own subprocess, so a crash shows as death by a signal, not a lost run."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from host_kernels import amx, native

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = """
import sys
import numpy as np
from host_kernels import activations, amx, f32_gemm
from host_kernels.errors import KernelArgumentError
from host_kernels.fused_forward import AVX512_F32, FusedForward, best_kernel, pack_layer
from host_kernels.store import ExpertStore
from host_kernels.layer_experts import LayerExperts

rng = np.random.default_rng(0)
store = ExpertStore({0: LayerExperts(rng.standard_normal((4, 32, 64), np.float32),
                                     rng.standard_normal((4, 32, 32), np.float32))})
x, ok_ids, ok_weights = np.ones((2, 32), np.float32), np.array([[1, 2], [1, 2]]), np.ones((2, 2), np.float32)

def fused(packed=lambda layer: pack_layer(store[layer], AVX512_F32), threads=1):
    if not best_kernel(store.dtype)[0]:  # the refusal to run on this CPU is the typed error
        raise KernelArgumentError(best_kernel(store.dtype)[1])
    return FusedForward(store, packed, threads)

try:
{body}
except KernelArgumentError as e:
    print(e)
    sys.exit(3)
"""

CASES = {
    # a hand-built packed weight whose k disagrees with its data (and, without AMX, the missing instruction set)
    "amx gemm, packed k disagrees": "amx.gemm(amx.row_buffer(16, 64), 16, amx.PackedWeight("
    "np.zeros((2, 1, 512), np.uint16), 64, 32), np.zeros((16, 32), np.float32))",
    "amx gemm, rows past the buffer": "w = amx.PackedWeight(np.zeros((2, 1, 512), np.uint16), 32, 32)\n"
    "amx.gemm(amx.pack_rows(np.ones((16, 32), np.float32), 32)[8:], 16, w, np.zeros((16, 32), np.float32))",
    "pack_rows, row index too large": "amx.pack_rows(np.ones((4, 32), np.float32), 32, rows=np.array([0, 10**9]))",
    "pack_rows, negative row index": "amx.pack_rows(np.ones((4, 32), np.float32), 32, rows=np.array([-5]))",
    "pack_rows, float row indices": "amx.pack_rows(np.ones((4, 32), np.float32), 32, rows=np.array([0.5]))",
    "pack_rows, kp below k": "amx.pack_rows(np.ones((4, 64), np.float32), 32)",
    "pack_rows, misaligned output": "out = np.zeros(16 * 32 + 1, np.uint16)[1:].reshape(16, 32)\n"
    "amx.pack_rows(np.ones((4, 32), np.float32), 32, out=out)",
    "f32 gemm, packed k disagrees": "w = f32_gemm.PackedF32(np.zeros((1, 4, 32), np.float32), 4096, 32)\n"
    "f32_gemm.gemm(np.ones((2, 4096), np.float32), w, np.zeros((2, 32), np.float32))",
    "f32 gemm, float64 packed data": "w = f32_gemm.PackedF32(np.zeros((1, 8, 32), np.float64), 8, 32)\n"
    "f32_gemm.gemm(np.ones((2, 8), np.float32), w, np.zeros((2, 32), np.float32))",
    "f32 gemm, read-only output": "out = np.zeros((2, 32), np.float32)\nout.flags.writeable = False\n"
    "f32_gemm.gemm(np.ones((2, 8), np.float32), f32_gemm.pack(np.ones((8, 32), np.float32)), out)",
    "f32 gemm, column range": "f32_gemm.gemm(np.ones((2, 8), np.float32), f32_gemm.pack(np.ones((8, 64), np.float32)), "
    "np.zeros((2, 48), np.float32), n0=16)",
    "fused, id above 2**32 (would wrap)": "fused().forward(0, x, np.array([[2**32 + 1, 2], [1, 2]]), ok_weights)",
    "fused, float ids": "fused().forward(0, x, np.array([[1.7, 2], [1, 2]]), ok_weights)",
    "fused, top_k = 0": "fused().forward(0, x, np.zeros((2, 0), np.int32), np.zeros((2, 0), np.float32))",
    "fused, integer routing weights": "fused().forward(0, x, ok_ids, np.ones((2, 2), np.int64))",
    "fused, wrong packed shape": "fused(lambda layer: [(f32_gemm.pack(np.ones((2, 2), np.float32)),) * 2] * 4)"
    ".forward(0, x, ok_ids, ok_weights)",
    "fused, too few packed experts": "fused(lambda layer: pack_layer(store[layer], AVX512_F32)[:1])"
    ".forward(0, x, ok_ids, ok_weights)",
    "fused, no threads": "fused(threads=0)",
    "fused, absurd threads": "fused(threads=10**7)",
    "swiglu, shapes disagree": "activations.swiglu_forward(np.ones((64, 64), np.float32), np.ones((2, 2), np.float32), "
    "np.zeros((64, 64), np.float32), isa='avx2')",
    "swiglu, read-only output": "act = np.zeros((4, 32), np.float32)\nact.flags.writeable = False\n"
    "activations.swiglu_forward(np.ones((4, 32), np.float32), np.ones((4, 32), np.float32), act, isa='avx2')",
    "engine, negative threads": "from host_kernels.host_moe import HostMoE\nHostMoE(store, threads=-1)",
    "engine, id out of range": "from host_kernels.host_moe import HostMoE\n"
    "HostMoE(store, threads=1).forward(0, x, np.array([[2**40, 2], [1, 2]]), ok_weights)",
    "xla handler, unknown call address": "import jax.numpy as jnp\nfrom moe_jax.native.host_experts import "
    "host_experts_call\nhost_experts_call(0xdeadbeef, jnp.ones((2, 32)), jnp.zeros((2, 2), jnp.int32), "
    "jnp.ones((2, 2)))",
}


@pytest.mark.parametrize("case", CASES)
def test_bad_native_arguments_raise_never_crash(case):
    body = textwrap.indent(CASES[case], "    ")
    result = subprocess.run(
        [sys.executable, "-c", PRELUDE.replace("{body}", body)], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert result.returncode >= 0, f"killed by signal {-result.returncode}"
    assert result.returncode == 3, result.stderr[-2000:]
    assert result.stdout.strip()  # the message


@pytest.mark.skipif(amx.status()[0], reason="this CPU has AMX: the refusal to run without it cannot be seen here")
def test_amx_gemm_without_amx_is_refused_not_sigill():
    from host_kernels.errors import KernelArgumentError

    w = amx.PackedWeight(np.zeros((2, 1, 512), np.uint16), 32, 32)
    with pytest.raises(KernelArgumentError, match="AMX GEMM unavailable: "):
        amx.gemm(amx.row_buffer(16, 32), 16, w, np.zeros((16, 32), np.float32))


def test_hidden_cpu_flags_are_absent_to_every_choice():
    """MOE_JAX_HIDE_CPU_FLAGS (prefixes) runs this machine as one without them: AMX refused, as on such a CPU,
    and the kernels chosen from what is left."""
    script = textwrap.dedent("""
        import ml_dtypes, numpy as np
        import moe_jax  # reads MOE_JAX_HIDE_CPU_FLAGS and hands it to host_kernels.native.hide_cpu_flags
        from host_kernels import amx, native
        from host_kernels.fused_forward import best_kernel
        assert not any(flag.startswith(("amx", "avx512")) for flag in native.cpu_flags())
        print(amx.status()[1])
        bf16 = ml_dtypes.bfloat16
        print(best_kernel(bf16)[0], best_kernel(bf16, "int8")[0], best_kernel(np.float32)[0])
    """)
    env = {**os.environ, native.HIDE_CPU_FLAGS: "amx, avx512"}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr
    why, kernels = run.stdout.splitlines()
    assert why.startswith("CPU lacks amx_tile, amx_bf16, avx512_bf16")
    avx2 = {"avx2", "fma"} <= native.cpu_flags()
    assert kernels.split() == (["avx2-bf16", "avx2-int8", "avx2-f32"] if avx2 else ["", "", ""])
