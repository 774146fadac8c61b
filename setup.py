"""Builds the host kernels' native library; everything else is declared in pyproject.toml.

The library is plain C loaded with ctypes (no Python C API), built in place by `pip install -e .`. It is optional:
where it cannot be built, the engine runs its numpy path and host_kernels.native.status() says why. The build
records the hash of its sources, so a library left from older sources is refused rather than called.
"""

import sys
from pathlib import Path

from setuptools import Extension, setup

sys.path.insert(0, str(Path(__file__).parent / "host_kernels"))
from native_sources import SOURCES, source_hash  # noqa: E402

setup(
    ext_modules=[
        Extension(
            "host_kernels._native",
            sources=[f"host_kernels/csrc/{name}" for name in SOURCES],
            extra_compile_args=["-O3"],
            define_macros=[("NATIVE_SOURCE_HASH", f'"{source_hash()}"')],
            optional=True,
        )
    ]
)
