"""The native library's sources and their hash: shared by setup.py (which compiles the hash in) and
host_kernels/native.py (which checks it). No imports beyond the standard library: setup.py loads this file
before the package is installed."""

import hashlib
from pathlib import Path

SOURCES = ("amx_gemm.c", "swiglu.c", "moe_forward.c", "source_hash.c")
HEADERS = ("simd.h", "moe_forward.h")
CSRC = Path(__file__).parent / "csrc"


def source_hash() -> str:
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update((CSRC / name).read_bytes())
    return digest.hexdigest()
