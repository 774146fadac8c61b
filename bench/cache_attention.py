"""A generation step's attention over a bfloat16 KV cache, decode and prefill: XLA's path (the cache written by a
select, every query against every entry under a mask) against the native handler's variants
(host_kernels/csrc/xla_cache_attention.c).

    python bench/cache_attention.py

One layer's attention for the bench model's heads (8 query / 2 KV heads of 64), Qwen3-30B-A3B's (32 / 4 of 128) and
MiniMax-M2's (48 / 8 of 128) over a 512-entry cache: decode at batch 1 and 16, the rows at positions 96 (a 32-token
prompt plus 64 new tokens, bench/infer.py's decode) and 511; prefill of one 512-token prompt from position 0. Each
jitted alone with the cache donated as in the generation steps; the best of 7 repeats. Every variant this CPU runs,
its output checked against XLA's to bfloat16 rounding. Writes bench/reports/cache_attention.md and
bench/results/cache_attention.json.
"""

from __future__ import annotations

import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import markdown_table, print_table, report_header, write_json, write_report  # noqa: E402
from moe_jax.model.layers import attend, write_positions  # noqa: E402
from moe_jax.native import cache_attention as native_attention  # noqa: E402

CACHE = 512
# (heads' name, kv heads, queries a kv head, head size)
HEADS = (("bench", 2, 4, 64), ("qwen3-30b-a3b", 4, 8, 128), ("minimax-m2", 8, 6, 128))
# (step, batch, new tokens a row, the first one's position)
STEPS = (
    *(("decode", batch, 1, position) for batch in (1, 16) for position in (96, CACHE - 1)),
    ("prefill", 1, CACHE, 0),
)


def attention_inputs(rng, batch, kv, g, d, tokens, position):
    """q, k_new, v_new, positions, k_cache, v_cache: random bfloat16, every row's tokens from `position` on."""

    def bf16(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)

    positions = jnp.broadcast_to(position + jnp.arange(tokens, dtype=jnp.int32), (batch, tokens))
    return (
        bf16(batch, kv, tokens, g, d),
        bf16(batch, kv, tokens, d),
        bf16(batch, kv, tokens, d),
        positions,
        *(bf16(batch, kv, CACHE, d) for _ in range(2)),
    )


def xla_attention(q, k_new, v_new, positions, k_cache, v_cache):
    key_pos = jnp.broadcast_to(jnp.arange(k_cache.shape[2]), (k_cache.shape[0], k_cache.shape[2]))
    k_all = write_positions(k_cache, k_new, positions, key_pos)
    v_all = write_positions(v_cache, v_new, positions, key_pos)
    return attend(q, k_all, v_all, positions, key_pos, None), k_all, v_all


def native_attention_on(isa):
    def run(q, k_new, v_new, positions, k_cache, v_cache):
        return native_attention.cache_attention_call(q, k_new, v_new, positions, k_cache, v_cache, None, isa)

    return run


def seconds(f, args, number) -> float:
    """A call's time, the donated caches threaded from call to call as the generation steps do."""
    q, k_new, v_new, positions, k_cache, v_cache = args
    state = [k_cache.copy(), v_cache.copy()]

    def once():
        out, state[0], state[1] = f(q, k_new, v_new, positions, *state)
        out.block_until_ready()

    once()
    return min(timeit.repeat(once, number=number, repeat=7)) / number


def main():
    variants = [isa for isa in native_attention.CPU_FLAGS if native_attention.status(isa)[0]]
    rows = []
    for name, kv, g, d in HEADS:
        for step, batch, tokens, position in STEPS:
            args = attention_inputs(np.random.default_rng(batch * position), batch, kv, g, d, tokens, position)
            number = 20 if step == "decode" else 2
            xla = jax.jit(xla_attention, donate_argnums=(4, 5))
            want = np.asarray(jax.jit(xla_attention)(*args)[0], np.float32)
            row = {"heads": name, "step": step, "batch": batch, "position": position if step == "decode" else "0-511"}
            row["xla_us"] = seconds(xla, args, number) * 1e6
            for isa in variants:
                f = jax.jit(native_attention_on(isa), donate_argnums=(4, 5))
                got = np.asarray(jax.jit(native_attention_on(isa))(*args)[0], np.float32)
                np.testing.assert_allclose(got, want, rtol=2**-7, atol=2**-9, err_msg=isa)
                row[f"{isa}_us"] = seconds(f, args, number) * 1e6
                row[f"{isa}_speedup"] = row["xla_us"] / row[f"{isa}_us"]
            rows.append(row)
    title = "attention over the KV cache, one layer, microseconds a call"
    print_table(title, rows)
    write_json("cache_attention", {"rows": rows})
    lines = report_header(f"{title}: XLA against the native handler")
    lines += [f"Threads: XLA:CPU's pool ({jax.local_devices()[0]}); bfloat16 cache of {CACHE} entries.", ""]
    write_report("cache_attention", lines + markdown_table(rows))


if __name__ == "__main__":
    main()
