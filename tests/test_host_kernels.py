"""host_kernels against a plain numpy reference and against jax.grad of a pure-JAX layer."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from host_kernels import activations, amx, bf16_gemm, choose_kernels
from host_kernels.errors import HostKernelError
from host_kernels.host_moe import HostMoE
from host_kernels.layer_experts import LayerExperts
from host_kernels.lora import ExpertLoRA
from host_kernels.schedule import Routing, plan_tiles
from host_kernels.store import ExpertStore
from tests.isa import variants

E, D, F, K = 6, 48, 80, 2


def make_layer(rng, dtype=np.float32):
    w13 = (rng.standard_normal((E, D, 2 * F)) / np.sqrt(D)).astype(dtype)
    w2 = (rng.standard_normal((E, F, D)) / np.sqrt(F)).astype(dtype)
    return LayerExperts(w13, w2)


def make_lora(rng, rank=4, scale=0.5, projections=("gate", "up", "down")):
    dims = {"gate": (D, F), "up": (D, F), "down": (F, D)}
    pairs = {
        p: (
            rng.standard_normal((E, dims[p][0], rank)).astype(np.float32) * 0.1,
            rng.standard_normal((E, rank, dims[p][1])).astype(np.float32) * 0.1,
        )
        for p in projections
    }
    return ExpertLoRA(scale, **pairs)


def routing(kind, tokens, rng):
    if kind == "uniform":
        ids = np.stack([rng.permutation(E)[:K] for _ in range(tokens)])
    elif kind == "skewed":  # Zipf-like: expert 0 takes most tokens
        p = 1.0 / np.arange(1, E + 1) ** 2
        ids = np.stack([rng.choice(E, K, replace=False, p=p / p.sum()) for _ in range(tokens)])
    elif kind == "empty":  # experts 1, 3 and 5 get nothing
        ids = np.stack([rng.choice([0, 2, 4], K, replace=False) for _ in range(tokens)])
    else:  # "partial": a third of the pairs are computed elsewhere (hybrid placement marks them -1)
        ids = np.stack([rng.permutation(E)[:K] for _ in range(tokens)])
        ids[rng.random(ids.shape) < 1 / 3] = -1
    weights = rng.uniform(0.1, 1.0, size=(tokens, K)).astype(np.float32)
    return ids, weights


def dense_weights(layer, lora):
    """Effective per-expert (gate, up, down) float64 matrices in x @ W layout."""
    w13, w2 = layer.w13.astype(np.float64), layer.w2.astype(np.float64)
    gate, up, down = w13[:, :, :F].copy(), w13[:, :, F:].copy(), w2.copy()
    if lora is not None:
        for name, base in (("gate", gate), ("up", up), ("down", down)):
            pair = getattr(lora, name)
            if pair is not None:
                base += lora.scale * np.einsum("eir,ero->eio", pair[0], pair[1])
    return gate, up, down


def numpy_reference_forward(layer, x, ids, weights, lora=None, round_to_bf16=False):
    """float64 reference; `round_to_bf16` rounds what the AMX path rounds: x and the activation (LoRA terms, which
    the kernels add in float32, make this exact only without LoRA)."""
    rounded = to_bf16 if round_to_bf16 else (lambda a: a)
    gate, up, down = dense_weights(layer, lora)
    y = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = ids[t, k]
            if e < 0:
                continue
            x_t = rounded(x[t])
            hg, hu = x_t @ gate[e], x_t @ up[e]
            y[t] += weights[t, k] * (rounded(hg / (1 + np.exp(-hg)) * hu) @ down[e])
    return y


def to_bf16(a):
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def assert_f32_close(got, expected):
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def assert_bf16_close(got, expected, tolerance=1e-2):
    """Within bfloat16 rounding as a whole (8 significant bits: 0.4% per value, less on average), while a wrong
    tile, column or transpose is off by the order of the values themselves."""
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    assert np.linalg.norm(got - expected) <= tolerance * np.linalg.norm(expected), (
        f"relative error {np.linalg.norm(got - expected) / np.linalg.norm(expected):.3g}"
    )


def jax_layer(layer, lora_arrays, scale, x, ids, weights):
    """Pure-JAX layer over gathered per-pair weights; differentiable in x, weights and LoRA arrays."""
    w13, w2 = jnp.asarray(layer.w13, jnp.float32), jnp.asarray(layer.w2, jnp.float32)
    gate, up, down = w13[:, :, :F], w13[:, :, F:], w2
    for name in lora_arrays:
        a, b = lora_arrays[name]
        delta = scale * jnp.einsum("eir,ero->eio", a, b)
        if name == "gate":
            gate = gate + delta
        elif name == "up":
            up = up + delta
        else:
            down = down + delta
    weights = jnp.where(ids >= 0, weights, 0.0)
    ids = jnp.maximum(ids, 0)
    hg = jnp.einsum("td,tkdf->tkf", x, gate[ids])
    hu = jnp.einsum("td,tkdf->tkf", x, up[ids])
    out = jnp.einsum("tkf,tkfd->tkd", jax.nn.silu(hg) * hu, down[ids])
    return jnp.einsum("tk,tkd->td", weights, out)


def lora_dict(lora):
    return {} if lora is None else {n: getattr(lora, n) for n in ("gate", "up", "down") if getattr(lora, n)}


@pytest.mark.parametrize("kind", ["uniform", "skewed", "empty", "partial"])
@pytest.mark.parametrize("storage", ["float32", "bfloat16", "bfloat16-amx", "bfloat16-avx512", "bfloat16-avx2"])
@pytest.mark.parametrize("with_lora", [False, True])
@pytest.mark.parametrize("threads", [1, 3])
def test_forward_and_backward_match_references(kind, storage, with_lora, threads):
    """float32 and bfloat16 storage on the numpy path compute in float32: tight tolerances. On AMX, AVX512-BF16 or
    AVX2 the inputs of every GEMM are rounded to bfloat16 too: the forward against a reference that rounds the same,
    the gradients (whose inputs are rounded along the way) against float32 ones within bfloat16 error."""
    gemm = {"bfloat16-amx": "amx-bf16", "bfloat16-avx512": "avx512-bf16", "bfloat16-avx2": "avx2-bf16"}.get(
        storage, "numpy"
    )
    on_amx = gemm != "numpy"  # (any bfloat16 kernel: the same roundings)
    status = {"amx-bf16": amx.status, "avx512-bf16": bf16_gemm.status, "avx2-bf16": lambda: bf16_gemm.status("avx2")}
    status = status.get(gemm, lambda: (True, ""))()
    if not status[0]:
        pytest.skip(f"{gemm} unavailable: {status[1]}")
    rng = np.random.default_rng(0)
    layer = make_layer(rng, np.float32 if storage == "float32" else ml_dtypes.bfloat16)
    lora = make_lora(rng) if with_lora else None
    tokens = 150
    x = rng.standard_normal((tokens, D)).astype(np.float32)
    ids, weights = routing(kind, tokens, rng)
    dy = rng.standard_normal((tokens, D)).astype(np.float32)
    store = ExpertStore({0: layer})
    kernels = dataclasses.replace(choose_kernels(store.dtype, native=on_amx), gemm=gemm)
    engine = HostMoE(store, threads=threads, kernels=kernels)
    assert engine.kernel == gemm

    y = engine.forward(0, x, ids, weights, lora)
    expected = numpy_reference_forward(layer, x, ids, weights, lora, round_to_bf16=on_amx)
    if on_amx:  # the same roundings, up to a last-bit flip where float32 and float64 activations straddle one
        assert_bf16_close(y, expected, tolerance=1e-4 if lora is None else 3e-3)
    else:
        assert_f32_close(y, expected)

    dx, dweights, dlora = engine.backward(0, x, ids, weights, dy, lora)
    recomputing_flops = engine.last_stats.flops
    arrays = {n: (jnp.asarray(a), jnp.asarray(b)) for n, (a, b) in lora_dict(lora).items()}
    scale = lora.scale if lora else 0.0

    def loss(x, weights, arrays):
        return jnp.sum(jax_layer(layer, arrays, scale, x, jnp.asarray(ids), weights) * dy)

    ref_dx, ref_dw, ref_dlora = jax.grad(loss, argnums=(0, 1, 2))(jnp.asarray(x), jnp.asarray(weights), arrays)
    close = assert_bf16_close if on_amx else assert_f32_close
    close(dx, ref_dx)
    close(dweights, ref_dw)
    if lora is None:
        assert dlora is None
    for name, (ga, gb) in ref_dlora.items():
        got_a, got_b = getattr(dlora, name)
        close(got_a, ga)
        close(got_b, gb)

    # keeping the forward's pre-activations gives the same gradients without recomputing them
    y_kept, saved = engine.forward_keeping(0, x, ids, weights, lora)
    np.testing.assert_array_equal(y_kept, y)
    kept = engine.backward(0, x, ids, weights, dy, lora, saved=saved)
    np.testing.assert_allclose(kept[0], dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(kept[1], dweights, rtol=1e-5, atol=1e-5)
    assert engine.last_stats.flops < recomputing_flops


def test_matches_pure_jax_ragged_dot_layer():
    from moe_jax.model.moe import DeviceExperts

    rng = np.random.default_rng(1)
    layer = make_layer(rng)
    x = rng.standard_normal((37, D)).astype(np.float32)
    ids, weights = routing("skewed", 37, rng)
    device = DeviceExperts(jnp.asarray(layer.w13), jnp.asarray(layer.w2))
    expected = device(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(weights))
    got = HostMoE(ExpertStore({0: layer}), threads=2).forward(0, x, ids, weights)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_single_token_decode():
    rng = np.random.default_rng(2)
    layer = make_layer(rng)
    x = rng.standard_normal((1, D)).astype(np.float32)
    ids, weights = routing("uniform", 1, rng)
    got = HostMoE(ExpertStore({0: layer}), threads=2).forward(0, x, ids, weights)
    np.testing.assert_allclose(got, numpy_reference_forward(layer, x, ids, weights), rtol=1e-5, atol=1e-5)


def test_hot_expert_is_split_across_workers():
    ids = np.zeros((400, 2), np.int64)
    ids[:, 1] = np.arange(400) % 5 + 1  # expert 0 gets every token, the rest share the second slot
    tiles = plan_tiles(Routing.build(ids, E), F, threads=2)
    hot = [t for t in tiles if t.expert == 0]
    assert len(hot) > 1 and all(t.cols == slice(0, F) for t in hot)  # plenty of rows: split by rows
    decode = plan_tiles(Routing.build(np.array([[0, 1]]), E), 256, threads=4)
    assert len(decode) > 2 and {(t.rows.start, t.rows.stop) for t in decode} == {(0, 1), (1, 2)}  # split by columns


def test_statistics_are_reported():
    rng = np.random.default_rng(3)
    layer = make_layer(rng)
    engine = HostMoE(ExpertStore({0: layer}), threads=2)
    x = rng.standard_normal((64, D)).astype(np.float32)
    ids, weights = routing("empty", 64, rng)
    engine.forward(0, x, ids, weights)
    s = engine.last_stats
    assert s.flops == pytest.approx(2 * 64 * K * D * 3 * F)
    assert s.weight_bytes == pytest.approx(3 * 3 * D * F * 4)  # three experts touched
    assert len(s.busy_s) == 2 and s.wall_s > 0 and s.imbalance >= 1.0
    assert s.tokens_per_expert.tolist() == np.bincount(ids.ravel(), minlength=E).tolist()


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda x, ids, w: (x[:, :-1], ids, w), "activations have shape"),
        (lambda x, ids, w: (x.astype(np.float64), ids, w), "must be float32"),
        (lambda x, ids, w: (x, ids + E, w), "out of range"),
        (lambda x, ids, w: (np.where(np.arange(D) == 3, np.nan, x).astype(np.float32), ids, w), "non-finite"),
        (lambda x, ids, w: (x, ids[:, :1], w), "routing weights has shape"),
    ],
)
def test_bad_input_names_layer_and_problem(change, message):
    rng = np.random.default_rng(4)
    engine = HostMoE(ExpertStore({7: make_layer(rng)}), threads=2)
    x = rng.standard_normal((8, D)).astype(np.float32)
    ids, weights = routing("uniform", 8, rng)
    with pytest.raises(HostKernelError, match=rf"layer 7: .*{message}"):
        engine.forward(7, *change(x, ids, weights))


def test_worker_failure_surfaces_in_caller(monkeypatch):
    import host_kernels.expert_matmuls as matmuls_module

    def broken(*args, **kwargs):
        raise RuntimeError("simulated BLAS failure")

    rng = np.random.default_rng(5)
    engine = HostMoE(ExpertStore({2: make_layer(rng)}), threads=3)
    x = rng.standard_normal((100, D)).astype(np.float32)
    ids, weights = routing("uniform", 100, rng)
    monkeypatch.setattr(matmuls_module, "matmul_w", broken)
    with pytest.raises(HostKernelError, match="layer 2: .*simulated BLAS failure"):
        engine.forward(2, x, ids, weights)
    monkeypatch.undo()
    np.testing.assert_allclose(  # the pool still works afterwards
        engine.forward(2, x, ids, weights), numpy_reference_forward(engine.store[2], x, ids, weights), atol=1e-4
    )


def test_a_freed_engine_ends_its_worker_threads():
    import gc
    import threading

    rng = np.random.default_rng(6)
    engine = HostMoE(ExpertStore({2: make_layer(rng)}), threads=3)
    x = rng.standard_normal((40, D)).astype(np.float32)
    engine.forward(2, x, *routing("uniform", 40, rng))
    helpers = engine.pool._helpers
    assert len(helpers) == 2 and all(t.is_alive() for t in helpers)
    del engine
    gc.collect()
    for t in helpers:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in helpers), [t.name for t in threading.enumerate()]


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5])
def test_decode_size_products_match_numpy(rows):
    from host_kernels.matmul import matmul_w

    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 64)).astype(np.float32)
    w = rng.standard_normal((64, 600)).astype(np.float32)  # wider than one panel
    np.testing.assert_allclose(matmul_w(x, w), x @ w, rtol=1e-5, atol=1e-5)
    out = np.zeros((rows, 600), np.float32)
    assert matmul_w(x, w, out=out) is out
    np.testing.assert_allclose(out, x @ w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", variants(activations.status))
@pytest.mark.parametrize("with_act", [False, True])
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
def test_native_swiglu_passes_match_numpy(with_act, out_dtype, isa):
    rng = np.random.default_rng(9)
    rows, cols = 7, 37  # a masked tail in every row
    h = rng.standard_normal((rows, 2 * cols)).astype(np.float32) * 4
    h[0, :4] = [-100.0, 100.0, -1e30, 1e30]  # saturating sigmoid: no overflow, no NaN
    grad = rng.standard_normal((rows, cols)).astype(np.float32)
    weight = rng.uniform(0.1, 1, rows).astype(np.float32)

    def run(pass_isa):
        hg, hu, g = h[:, :cols].copy(), h[:, cols:].copy(), grad.copy()  # the numpy path works in place
        # bfloat16 outputs travel as uint16 bits (what the AMX GEMM reads), widened here to compare
        out = np.float32 if out_dtype == "float32" else np.uint16
        act_f = np.empty((rows, cols), out)
        activations.swiglu_forward(hg, hu, act_f, isa=pass_isa)
        dh = np.empty((rows, 2 * cols), out)
        dw = np.empty((rows, 3), np.float32)[:, 1]  # a strided column, as the engine passes
        act_b = np.empty((rows, cols), np.float32) if with_act else None
        activations.swiglu_backward(hg, hu, g, weight, dh[:, :cols], dh[:, cols:], dw, act_b, isa=pass_isa)
        return [widen(a) for a in (act_f, dh, dw.copy(), act_b)]

    def widen(a):
        return a if a is None or a.dtype == np.float32 else a.view(ml_dtypes.bfloat16).astype(np.float32)

    native = run(isa)
    reference = run(None)
    rtol = 2e-5 if out_dtype == "float32" else 2**-8  # one bfloat16 step where float32 results straddle a rounding
    for got, expected in zip(native, reference, strict=True):
        if expected is not None:
            assert np.isfinite(got).all()
            np.testing.assert_allclose(got, expected, rtol=rtol, atol=1e-5)


def test_every_native_source_is_in_the_build_hash():
    """An edit to any file in csrc/ makes the built library stale (the loader compares this hash)."""
    from host_kernels import native_sources as ns

    assert set(ns.ALL_SOURCES) == {path.name for path in ns.CSRC.iterdir() if path.suffix in (".c", ".h")}


def test_stale_native_library_is_refused(monkeypatch):
    from host_kernels import native

    if native.library_path() is None:
        pytest.skip("native library not built")
    native._loadable.cache_clear()
    monkeypatch.setattr(native, "source_hash", lambda: "0" * 64)  # as if csrc/ changed since the build
    try:
        usable, reason = native.status(())
        assert not usable and "built from other sources" in reason
    finally:
        native._loadable.cache_clear()
