"""A decode step's attention over a bfloat16 KV cache: XLA's path against the native handler's variants
(host_kernels/csrc/xla_decode_attention.c).

    python bench/decode_attention.py

One layer's attention at batch 1 and 16 for the bench model's heads (8 query / 2 KV heads of 64) and Qwen3-30B-A3B's
(32 / 4 of 128), the rows at positions 96 (a 32-token prompt plus 64 new tokens, bench/infer.py's decode) and 511 of
a 512-entry cache, each jitted alone with the cache donated as in the decode step; the best of 7 repeats of 20
calls. Every variant this CPU runs, its output checked against XLA's to bfloat16 rounding. Writes
bench/results/decode_attention.json.
"""

from __future__ import annotations

import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import print_table, write_json  # noqa: E402
from moe_jax.model.layers import attend, write_positions  # noqa: E402
from moe_jax.native import decode_attention as native_attention  # noqa: E402

CACHE = 512
# (heads' name, kv heads, queries a kv head, head size)
HEADS = (("bench", 2, 4, 64), ("qwen3-30b-a3b", 4, 8, 128))
CASES = tuple((heads, batch, position) for heads in HEADS for batch in (1, 16) for position in (96, CACHE - 1))


def attention_inputs(rng, batch, kv, g, d, position):
    """q, k_new, v_new, positions, k_cache, v_cache: random bfloat16, every row at `position`."""

    def bf16(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)

    positions = jnp.full((batch, 1), position, jnp.int32)
    return (
        bf16(batch, kv, g, d),
        bf16(batch, kv, 1, d),
        bf16(batch, kv, 1, d),
        positions,
        *(bf16(batch, kv, CACHE, d) for _ in range(2)),
    )


def xla_attention(q, k_new, v_new, positions, k_cache, v_cache):
    key_pos = jnp.broadcast_to(jnp.arange(k_cache.shape[2]), (k_cache.shape[0], k_cache.shape[2]))
    k_all = write_positions(k_cache, k_new, positions, key_pos)
    v_all = write_positions(v_cache, v_new, positions, key_pos)
    return attend(q[:, :, None], k_all, v_all, positions, key_pos, None)[:, :, 0], k_all, v_all


def native_attention_on(isa):
    def run(q, k_new, v_new, positions, k_cache, v_cache):
        return native_attention.decode_attention_call(q, k_new, v_new, positions, k_cache, v_cache, None, isa)

    return run


def seconds(f, args) -> float:
    """A call's time, the donated caches threaded from call to call as the decode steps do."""
    q, k_new, v_new, positions, k_cache, v_cache = args
    state = [k_cache.copy(), v_cache.copy()]

    def once():
        out, state[0], state[1] = f(q, k_new, v_new, positions, *state)
        out.block_until_ready()

    once()
    return min(timeit.repeat(once, number=20, repeat=7)) / 20


def main():
    variants = [isa for isa in native_attention.CPU_FLAGS if native_attention.status(isa)[0]]
    rows = []
    for (name, kv, g, d), batch, position in CASES:
        args = attention_inputs(np.random.default_rng(batch * position), batch, kv, g, d, position)
        xla = jax.jit(xla_attention, donate_argnums=(4, 5))
        want = np.asarray(jax.jit(xla_attention)(*args)[0], np.float32)
        row = {"heads": name, "batch": batch, "position": position, "xla_us": seconds(xla, args) * 1e6}
        for isa in variants:
            f = jax.jit(native_attention_on(isa), donate_argnums=(4, 5))
            got = np.asarray(jax.jit(native_attention_on(isa))(*args)[0], np.float32)
            np.testing.assert_allclose(got, want, rtol=2**-7, atol=2**-9, err_msg=isa)
            row[f"{isa}_us"] = seconds(f, args) * 1e6
            row[f"{isa}_speedup"] = row["xla_us"] / row[f"{isa}_us"]
        rows.append(row)
    print_table("decode attention, one layer, microseconds a call", rows)
    write_json("decode_attention", {"rows": rows})


if __name__ == "__main__":
    main()
