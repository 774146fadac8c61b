"""Refusing, before allocating, what would not fit in memory: a model load (dense weights, stacked experts, the
host kernels' packed copies) and a generation's KV cache.

How it works and why: docs/INTERNALS.md, moe_jax/planning/memory_check.py.
"""

from __future__ import annotations

import math
from pathlib import Path

from host_kernels import KernelChoice, quantized_expert_bytes
from moe_jax.errors import MemoryLimitError
from moe_jax.formats.hf_names import is_expert_tensor


def human_size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n} bytes"


def available_bytes() -> int | None:
    """Memory a new allocation can get on this machine, or None where it cannot be read (no /proc)."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        free = (int(fields["MemAvailable"].split()[0]) + int(fields.get("SwapFree", "0 kB").split()[0])) * 1024
    except (OSError, KeyError, ValueError):
        return None
    room = _cgroup_room()
    return free if room is None else min(free, room)


def _cgroup_room() -> int | None:
    """What the cgroup (v2) memory limit still allows, where one is set."""
    base = Path("/sys/fs/cgroup")
    try:
        limit = (base / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((base / "memory.current").read_text()))
    except (OSError, ValueError):
        return None


def load_bytes(checkpoint, itemsize: int, host_kernels: KernelChoice | None, shards: int = 1) -> dict[str, int]:
    """What loading `checkpoint` at `itemsize` bytes per weight allocates, by part; `host_kernels`: the kernels
    that run the experts on the host (None: the backend runs none), whose fused native forward, where there is
    one, packs each expert once into its own tile layout; `shards`: a process holds 1/shards of the experts."""
    tensors = checkpoint.tensors
    dense = sum(math.prod(tensors.shape(n)) for n in tensors.names() if not is_expert_tensor(n)) * itemsize
    store = checkpoint.expert_store
    if host_kernels is not None and host_kernels.quantized:  # held only quantized: the store's own mapped file,
        mapped = store is not None and store.quant == host_kernels.quant  # or quantized at load, layer by layer
        packed = 0 if mapped else quantized_experts_bytes(checkpoint, host_kernels.quant) // shards
        return {"dense weights": dense, "experts": 0, "packed expert copies": packed}
    c = checkpoint.config
    params = 3 * c.hidden_size * c.expert_intermediate_size * c.num_experts * len(c.moe_layers) // shards
    packed_itemsize = host_kernels.packed_bytes_per_weight() if host_kernels is not None else 0
    store_itemsize = store.dtype.itemsize if store is not None else itemsize
    return {
        "dense weights": dense,
        "experts": 0 if store is not None and store_itemsize == itemsize else params * itemsize,
        "packed expert copies": int(params * packed_itemsize),
    }


def quantized_experts_bytes(checkpoint, quant: str) -> int:
    """Bytes of every routed expert of `checkpoint` held in format `quant`, packed, scales included."""
    c = checkpoint.config
    return quantized_expert_bytes(quant, c.hidden_size, c.expert_intermediate_size) * c.num_experts * len(c.moe_layers)


def check_fits(parts: dict[str, int], what: str, available: int | None = None, hint: str = ""):
    """Raises MemoryLimitError naming each part when their sum exceeds the available memory (and `hint`: another
    way to fit, if there is one)."""
    available = available_bytes() if available is None else available
    need = sum(parts.values())
    if available is None or need <= available:
        return
    listed = ", ".join(f"{name} {human_size(size)}" for name, size in parts.items() if size)
    raise MemoryLimitError(
        f"{what} needs about {human_size(need)} ({listed}) but this machine has {human_size(available)} available; "
        f"use a machine with more memory, a smaller dtype, or fewer sequences at a time{hint}"
    )


def quantization_hint(checkpoint, parts: dict[str, int]) -> str:
    """ "; with quant='int4' ..." where holding the experts quantized would shrink the load (their float bytes
    replaced by int4's), else ""."""
    floats = parts.get("experts", 0) + parts.get("packed expert copies", 0)
    if not floats:
        return ""
    experts = quantized_experts_bytes(checkpoint, "int4")
    need = sum(parts.values()) - floats + experts
    return (
        f"; with quant='int4' (infer.py / train.py --quant int4, or `moe_jax.convert --quant int4`) the host "
        f"experts are held in {human_size(experts)}, about {human_size(need)} in all"
    )
