"""Host expert engine against what this CPU can do, measured side by side in one run.

    python bench/host_kernels.py [--hidden 512 --ffn 1408 --experts 8 --top-k 2] [--native-blas] [--quick]

Reports, for one MoE layer of the given shape:
  * forward and forward+backward GFLOP/s as a fraction of numpy's own GEMMs of the same total size;
  * decode (1-16 tokens): weight bytes read per second as a fraction of a plain numpy memory copy, for the engine
    and for the fused native forward (host_kernels/fused_forward.py: float32 on AVX-512, bfloat16 on AMX);
  * skew: Zipf-routed batch time over uniform-routed time at the same number of (token, expert) pairs;
  * the pure-JAX `ragged_dot` layer (moe_jax's device backend) on this CPU, as a time ratio;
  * where the CPU has AMX: the same layer stored in bfloat16 on the AMX kernel, GFLOP/s and speed-up.
Every figure is the best of several runs, on every side alike. Writes bench/results/host_kernels.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import (  # noqa: E402
    gemv_streaming,
    machine_info,
    print_table,
    reexec_with_native_blas_if_asked,
    write_json,
)
from bench.common import timed as common_timed  # noqa: E402

reexec_with_native_blas_if_asked(sys.argv)

import numpy as np  # noqa: E402

from host_kernels import amx  # noqa: E402
from host_kernels.host_moe import HostMoE  # noqa: E402
from host_kernels.layer_experts import LayerExperts  # noqa: E402
from host_kernels.store import ExpertStore  # noqa: E402


def timed(fn, repeats):
    """Best (minimum) of `repeats` timed runs: every side of every ratio here is measured the same way."""
    return common_timed(fn, repeats, best=True)


def make_routing(rng, tokens, experts, top_k, skew: float):
    """Top-k distinct experts per token; skew=0 uniform, else Zipf with that exponent."""
    p = 1.0 / np.arange(1, experts + 1) ** skew
    p /= p.sum()
    ids = np.stack([rng.choice(experts, top_k, replace=False, p=p) for _ in range(tokens)])
    weights = rng.uniform(0.2, 1.0, (tokens, top_k)).astype(np.float32)
    return ids, weights


def numpy_gemm_seconds(rng, rows, d, f, repeats):
    """numpy's own GEMMs of the layer's total size: [pairs, d] @ [d, 2f] and [pairs, f] @ [f, d]."""
    a, w13 = rng.standard_normal((rows, d), np.float32), rng.standard_normal((d, 2 * f), np.float32)
    b, w2 = rng.standard_normal((rows, f), np.float32), rng.standard_normal((f, d), np.float32)
    return timed(lambda: (a @ w13, b @ w2), repeats)


def memcpy_gbps(rng, nbytes, repeats):
    src = rng.standard_normal(nbytes // 4).astype(np.float32)
    dst = np.empty_like(src)
    return nbytes / timed(lambda: np.copyto(dst, src), repeats) / 1e9


def jax_layer(layer: LayerExperts):
    import jax
    import jax.numpy as jnp

    from moe_jax.model.moe import DeviceExperts

    experts = DeviceExperts(jnp.asarray(layer.w13), jnp.asarray(layer.w2))
    forward = jax.jit(lambda x, ids, w: experts(x, ids, w))
    grad = jax.jit(jax.grad(lambda x, ids, w, dy: jnp.sum(experts(x, ids, w) * dy), argnums=(0, 2)))
    return forward, grad


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=1408)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="fewer sizes, for a smoke run")
    parser.add_argument("--native-blas", action="store_true", help="unset OPENBLAS_CORETYPE for this process")
    args = parser.parse_args()
    d, f, e, k = args.hidden, args.ffn, args.experts, args.top_k
    rng = np.random.default_rng(0)
    layer = LayerExperts(
        (rng.standard_normal((e, d, 2 * f)) / np.sqrt(d)).astype(np.float32),
        (rng.standard_normal((e, f, d)) / np.sqrt(f)).astype(np.float32),
    )
    engine = HostMoE(ExpertStore({0: layer}), threads=args.threads)
    bf16 = LayerExperts(layer.w13.astype(amx.BF16), layer.w2.astype(amx.BF16))
    amx_engine = HostMoE(ExpertStore({0: bf16}), threads=args.threads)
    amx_engine = amx_engine if amx_engine.kernel == "amx-bf16" else None
    print(f"AMX bfloat16 kernel: {'yes' if amx_engine else 'no (' + amx.status()[1] + ')'}")
    print(f"layer: hidden {d}, ffn {f}, {e} experts, top-{k}; {engine.threads} worker threads")
    print(machine_info())
    jax_forward, jax_grad = jax_layer(layer)
    results = {"shape": {"hidden": d, "ffn": f, "experts": e, "top_k": k, "threads": engine.threads}}

    # -- throughput at prefill / training sizes
    rows = []
    for tokens in [1024] if args.quick else [256, 1024, 2048, 4096]:
        x = rng.standard_normal((tokens, d)).astype(np.float32)
        ids, w = make_routing(rng, tokens, e, k, skew=0.0)
        dy = rng.standard_normal((tokens, d)).astype(np.float32)
        fwd = timed(lambda x=x, ids=ids, w=w: engine.forward(0, x, ids, w), args.repeats)
        fwd_flops = engine.last_stats.flops
        fb = timed(
            lambda x=x, ids=ids, w=w, dy=dy: (engine.forward(0, x, ids, w), engine.backward(0, x, ids, w, dy)),
            args.repeats,
        )
        engine.backward(0, x, ids, w, dy)
        fb_flops = fwd_flops + engine.last_stats.flops
        gemm = numpy_gemm_seconds(rng, tokens * k, d, f, args.repeats)
        peak = fwd_flops / gemm / 1e9  # numpy's GFLOP/s on GEMMs of the same total size
        jf = timed(lambda x=x, ids=ids, w=w: jax_forward(x, ids, w).block_until_ready(), args.repeats)
        jfb = timed(lambda x=x, ids=ids, w=w, dy=dy: jax.block_until_ready(jax_grad(x, ids, w, dy)), args.repeats)
        row = {
            "tokens": tokens,
            "numpy_gemm_gflops": peak,
            "fwd_gflops": fwd_flops / fwd / 1e9,
            "fwd_vs_gemm": fwd_flops / fwd / 1e9 / peak,
            "fwd_bwd_gflops": fb_flops / fb / 1e9,
            "fwd_bwd_vs_gemm": fb_flops / fb / 1e9 / peak,
            "jax_fwd_over_host": jf / fwd,
            "jax_fwd_bwd_over_host": jfb / fb,
        }
        if amx_engine is not None:
            amx_fb = timed(
                lambda x=x, ids=ids, w=w, dy=dy: (
                    amx_engine.forward(0, x, ids, w),
                    amx_engine.backward(0, x, ids, w, dy),
                ),
                args.repeats,
            )
            row["amx_bf16_fwd_bwd_gflops"] = fb_flops / amx_fb / 1e9
            row["amx_bf16_speedup"] = fb / amx_fb
        rows.append(row)
    print_table("throughput (uniform routing; *_vs_gemm = fraction of numpy GEMM GFLOP/s)", rows)
    results["throughput"] = rows

    # -- decode: weight streaming. A decode step reads every layer's routed experts once, so the layers' weights
    # together exceed the last-level cache: time a pass over enough distinct layer copies (>= 256 MiB), or
    # one layer would be served from cache and overstate RAM streaming.
    copy = memcpy_gbps(rng, 256 << 20, args.repeats)
    gemv = gemv_streaming(rng, 256 << 20, engine.threads)(args.repeats)
    n_layers = max(1, -(-(256 << 20) // (layer.w13.nbytes + layer.w2.nbytes)))
    decode_store = ExpertStore({i: LayerExperts(layer.w13.copy(), layer.w2.copy()) for i in range(n_layers)})
    decode_engine = HostMoE(decode_store, threads=args.threads)

    def decode_step(x, ids, w):
        read = 0
        for i in range(n_layers):
            decode_engine.forward(i, x, ids, w)
            read += decode_engine.last_stats.weight_bytes
        return read

    # the fused forward over the same float32 layers, and over as many bytes of bfloat16 layers where there is AMX
    fused_sides = {"fused_f32": (decode_engine.fused_forward(), n_layers)}
    if amx_engine is not None:
        n16 = 2 * n_layers
        bf16_layers = {i: LayerExperts(layer.w13.astype(amx.BF16), layer.w2.astype(amx.BF16)) for i in range(n16)}
        fused_sides["fused_bf16"] = (HostMoE(ExpertStore(bf16_layers), threads=args.threads).fused_forward(), n16)

    def fused_step(fused, layers, x, ids, w):
        for i in range(layers):
            fused.forward(i, x, ids, w)
        return fused.take_totals().weight_bytes

    rows = []
    for tokens in [1, 16] if args.quick else [1, 2, 4, 8, 16]:
        x = rng.standard_normal((tokens, d)).astype(np.float32)
        ids, w = make_routing(rng, tokens, e, k, skew=0.0)
        t = timed(lambda x=x, ids=ids, w=w: decode_step(x, ids, w), args.repeats) / n_layers
        gbps = decode_step(x, ids, w) / n_layers / t / 1e9
        jf = timed(lambda x=x, ids=ids, w=w: jax_forward(x, ids, w).block_until_ready(), args.repeats * 4)
        row = {
            "tokens": tokens,
            "us": t * 1e6,
            "weight_gbps": gbps,
            "memcpy_gbps": copy,
            "vs_memcpy": gbps / copy,
            "gemv_gbps": gemv,
            "vs_gemv": gbps / gemv,
            "jax_over_host": jf / t,
        }
        for name, (fused, layers) in fused_sides.items():
            if fused is None:
                continue
            tf = timed(lambda f=fused, n=layers, x=x, ids=ids, w=w: fused_step(f, n, x, ids, w), args.repeats)
            fused.take_totals()
            row[f"{name}_us"] = tf / layers * 1e6
            row[f"{name}_weight_gbps"] = fused_step(fused, layers, x, ids, w) / layers / (tf / layers) / 1e9
            row[f"{name}_vs_gemv"] = row[f"{name}_weight_gbps"] / gemv
        rows.append(row)
    print_table(
        f"decode (per layer, {n_layers} distinct layers in turn; weight bytes read per second vs numpy "
        "copy of 256 MiB and vs GEMVs streaming 256 MiB on the engine's threads)",
        rows,
    )
    results["decode"] = rows

    # -- skew
    rows = []
    for tokens in [64, 1024] if args.quick else [16, 64, 256, 1024, 4096]:
        x = rng.standard_normal((tokens, d)).astype(np.float32)
        uniform = make_routing(rng, tokens, e, k, skew=0.0)
        zipf = make_routing(rng, tokens, e, k, skew=1.5)
        tu = timed(lambda x=x, r=uniform: engine.forward(0, x, *r), args.repeats * 2)
        tz = timed(lambda x=x, r=zipf: engine.forward(0, x, *r), args.repeats * 2)
        engine.forward(0, x, *zipf)
        rows.append(
            {
                "tokens": tokens,
                "uniform_ms": tu * 1e3,
                "zipf_ms": tz * 1e3,
                "zipf_over_uniform": tz / tu,
                "zipf_hot_share": float(engine.last_stats.tokens_per_expert.max() / (tokens * k)),
                "zipf_imbalance": engine.last_stats.imbalance,
            }
        )
    print_table("skew (Zipf s=1.5 vs uniform, same pair count)", rows)
    results["skew"] = rows
    write_json("host_kernels", results)


if __name__ == "__main__":
    import jax

    main()
